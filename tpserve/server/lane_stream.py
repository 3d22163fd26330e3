"""A client's handle on one reply: its events in order (Prefilled, TokenDelta..., Finished) and cancel.

The lane host puts events from its scheduling thread; any thread reads them or cancels. Nothing here
ever waits on the scheduler: cancel only leaves a note the scheduler acts on at its next boundary.
A reader that stops reading (its client's connection full) would let every token of its reply pile
up here: with bound_unread, the stream cancels itself once more tokens than that wait unread.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterator

from tpserve.server.requests import Event, Finished, TokenDelta


class Stream:
    def __init__(self, cancel: Callable[[], None]):
        self._cancel = cancel
        self._cond = threading.Condition()
        self._events: deque[Event] = deque()
        self._finished: Finished | None = None
        self._final_read = False
        self._listener: Callable[[], None] | None = None
        self._unread_tokens = 0  # in the TokenDeltas put and not yet read
        self._max_unread_tokens: int | None = None
        self._on_overflow: list[Callable[[], None]] = []
        self.overflowed = False  # cancelled for max_unread_tokens

    @property
    def finished(self) -> Finished | None:
        """The Finished event once the host has sent it (read or not)."""
        return self._finished

    def put(self, event: Event) -> None:
        """Called by the lane host. Anything after Finished is dropped, so ending a stream twice is harmless."""
        overflowed = False
        with self._cond:
            if self._finished is not None:
                return
            if isinstance(event, Finished):
                self._finished = event
            elif isinstance(event, TokenDelta):
                self._unread_tokens += len(event.token_ids)
                limit = self._max_unread_tokens
                overflowed = limit is not None and self._unread_tokens > limit and not self.overflowed
                self.overflowed = self.overflowed or overflowed
            self._events.append(event)
            self._cond.notify_all()
            listener = self._listener
        if listener is not None:
            listener()
        if overflowed:
            self._overflow()

    def bound_unread(self, max_tokens: int) -> None:
        """From now on, once more than max_tokens tokens wait unread, call every on_overflow callback
        (on the putting thread) and cancel: a client that stopped reading holds no lane, and its
        reply no more memory than that."""
        with self._cond:
            self._max_unread_tokens = max_tokens

    def on_overflow(self, callback: Callable[[], None]) -> None:
        """Call `callback` when bound_unread cancels this stream (now, if it already did)."""
        with self._cond:
            self._on_overflow.append(callback)
            overflowed = self.overflowed
        if overflowed:
            callback()

    def _overflow(self) -> None:
        with self._cond:
            callbacks = list(self._on_overflow)
        for callback in callbacks:
            callback()
        self._cancel()

    def listen(self, listener: Callable[[], None]) -> None:
        """Call `listener` (outside the stream's lock, on the putting thread) after every event from
        now on, and once now if events wait: a reader of many streams (tpserve/server/front_link.py) learns
        which have news without a thread per stream."""
        with self._cond:
            self._listener = listener
            waiting = bool(self._events)
        if waiting:
            listener()

    def next_event(self, timeout: float | None) -> Event | None:
        """The next event, or None after `timeout` seconds without one (or once Finished was read)."""
        with self._cond:
            self._cond.wait_for(lambda: self._events or self._final_read, timeout)
            if not self._events:
                return None
            event = self._events.popleft()
            if isinstance(event, TokenDelta):
                self._unread_tokens -= len(event.token_ids)
            if isinstance(event, Finished):
                self._final_read = True
            return event

    def next_events(self, timeout: float | None) -> list[Event]:
        """Every event waiting now (after up to `timeout` seconds for the first), in order: a
        reader that sends what a round produced in one message, not one per token."""
        with self._cond:
            self._cond.wait_for(lambda: self._events or self._final_read, timeout)
            events = list(self._events)
            self._events.clear()
            self._unread_tokens = 0
            if any(isinstance(event, Finished) for event in events):
                self._final_read = True
            return events

    def events(self, timeout_each: float) -> Iterator[Event]:
        """Every event up to and including Finished; TimeoutError if the host goes quiet that long."""
        while True:
            event = self.next_event(timeout_each)
            if event is None:
                if self._final_read:
                    return
                raise TimeoutError(f"the lane host sent no event for {timeout_each} s")
            yield event
            if isinstance(event, Finished):
                return

    def cancel(self) -> None:
        """End the reply early (Finished "cancelled"); safe from any thread, returns at once."""
        self._cancel()


def merge_deltas(events: list[Event]) -> list[Event]:
    """Consecutive token deltas as one (their log probabilities too): the tokens a round released
    reach the client in one message."""
    merged: list[Event] = []
    for event in events:
        if isinstance(event, TokenDelta) and merged and isinstance(merged[-1], TokenDelta):
            previous = merged[-1]
            merged[-1] = TokenDelta(
                previous.token_ids + event.token_ids,
                previous.text + event.text,
                previous.logprobs + event.logprobs,
            )
        else:
            merged.append(event)
    return merged
