"""The front process's engine: the lane host in rank 0's engine process, reached over the front link.

RemoteEngine is an EngineClient (tpserve/server/engine_client.py) like the LaneHost itself, so the
Submitter and both APIs do not care which they have. A submit is a round trip (the lane host's own
refusals, queue full, stopping or broken, come back at once and raise as they would in-process);
the engine sends bare tokens, one StepOut per step for every stream, and each stream's RemoteReply
makes the text here: detokenizing, stop strings (a match ends the reply here and cancels the
engine's stream, as vLLM's output processor aborts it), the same TokenDelta events and usage the
in-process lane host sends. The engine gone (its socket closed) latches broken: every live stream
ends with an error, new requests hear UNAVAILABLE, and `gone` is set so the front exits.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from multiprocessing.connection import Connection

from tpserve.server.front_wire import (
    BLOCK_STATS,
    QUEUE_FULL,
    STATS,
    UNAVAILABLE,
    Answer,
    Ask,
    Cancel,
    StepOut,
    StreamOut,
    Submit,
    SubmitAnswer,
)
from tpserve.server.kv_blocks import BlockStats
from tpserve.server.lane_stream import Stream
from tpserve.server.reply_text import ReplyText, ends_reply
from tpserve.server.requests import (
    ERROR,
    STOP,
    Finished,
    GenerationRequest,
    HostStats,
    HostUnavailable,
    QueueFull,
    Usage,
)

log = logging.getLogger(__name__)

ANSWER_TIMEOUT_S = 30.0  # a submit or a stats ask the engine's reader does not answer in this long
ENGINE_GONE = "the engine process went away"


class RemoteReply:
    """One stream's text, made from the engine's bare tokens."""

    def __init__(
        self,
        request: GenerationRequest,
        detokenize: Callable[[Sequence[int]], str],
        eos_ids: frozenset[int],
        cancel: Callable[[], None],
    ):
        self._request = request
        self._eos_ids = eos_ids
        self._cancel_engine = cancel
        self.stream = Stream(cancel)
        self._text = ReplyText(request, detokenize, self.stream.put)
        self._submitted_at = time.monotonic()
        self._first_token_at: float | None = None
        self._cached_tokens = 0
        self._ended = False  # the reply's last token came: what follows is the engine running on

    def apply(self, out: StreamOut) -> None:
        if out.prefilled is not None:
            self._cached_tokens = out.prefilled.cached_tokens
            self.stream.put(out.prefilled)  # with the prompt's log probabilities, when asked
        for index, token_id in enumerate(out.token_ids):
            if self._ended:
                break
            if self._first_token_at is None:
                self._first_token_at = time.monotonic()
            ends = ends_reply(self._request, token_id, self._eos_ids)
            logprob = out.logprobs[index] if out.logprobs else None
            reason = self._text.take(token_id, logprob, ends)
            if reason is None:
                continue
            self._ended = True
            if reason == STOP and not ends:  # a stop string: the engine cannot know, so it is told
                self.stream.put(Finished(STOP, self._usage()))
                self._cancel_engine()
        if out.finished is not None:
            self.stream.put(out.finished)  # dropped when a stop string already ended the reply

    def fail(self, reason: str) -> None:
        self.stream.put(Finished(ERROR, self._usage(), f"engine broken: {reason}"))

    def _usage(self) -> Usage:
        now = time.monotonic()
        first = None if self._first_token_at is None else self._first_token_at - self._submitted_at
        return Usage(
            prompt_tokens=len(self._request.prompt_ids),
            completion_tokens=self._text.num_tokens,
            cached_tokens=self._cached_tokens,
            time_to_first_token_s=first,
            total_s=now - self._submitted_at,
        )


class RemoteEngine:
    def __init__(
        self,
        conn: Connection,
        detokenize: Callable[[Sequence[int]], str],
        eos_ids: frozenset[int],
        stats: HostStats,
        block_stats: BlockStats,
        detokenize_special: Callable[[Sequence[int]], str] | None = None,
    ):
        """stats, block_stats: what metrics read until the engine's first answer (and once it is gone).
        detokenize_special: the text with special tokens kept, for requests that set
        skip_special_tokens false; None: such requests are refused, as the lane host refuses them."""
        self._conn = conn
        self._detokenize = detokenize
        self._detokenize_special = detokenize_special
        self._eos_ids = frozenset(eos_ids)
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()
        self._replies: dict[int, RemoteReply] = {}
        self._answers: dict[int, queue.SimpleQueue] = {}
        self._ids = itertools.count(1)
        self._broken: str | None = None
        self._last = {STATS: stats, BLOCK_STATS: block_stats}
        self.controls: queue.SimpleQueue = queue.SimpleQueue()  # BeginStopping, StopApis for the front's main
        self.gone = threading.Event()

    def start(self) -> None:
        threading.Thread(target=self._read, name="engine-read", daemon=True).start()

    @property
    def broken(self) -> bool:
        return self._broken is not None

    def submit(self, request: GenerationRequest) -> Stream:
        """As LaneHost.submit: raises QueueFull, HostUnavailable, or ValueError."""
        if self._broken is not None:
            raise HostUnavailable(f"the engine is broken: {self._broken}")
        detokenize = self._detokenize if request.skip_special_tokens else self._detokenize_special
        if detokenize is None:
            raise ValueError("this server cannot keep special tokens in a reply's text")
        stream_id = next(self._ids)
        reply = RemoteReply(request, detokenize, self._eos_ids, lambda: self._cancel(stream_id))
        grammar = request.grammar
        message = Submit(stream_id, replace(request, grammar=None), None if grammar is None else grammar.text)
        with self._lock:
            self._replies[stream_id] = reply
        answer: SubmitAnswer = self._ask(stream_id, message)
        if answer.refusal is None:
            return reply.stream
        with self._lock:
            self._replies.pop(stream_id, None)
        if answer.broken is not None:
            self._latch(answer.broken)
        if answer.refusal == QUEUE_FULL:
            raise QueueFull(answer.message)
        if answer.refusal == UNAVAILABLE:
            raise HostUnavailable(answer.message)
        raise ValueError(answer.message)

    def stats(self) -> HostStats:
        return self._stats(STATS)

    def block_stats(self) -> BlockStats:
        return self._stats(BLOCK_STATS)

    def _stats(self, what: str):
        if self.gone.is_set():
            return self._last[what]
        ask_id = -next(self._ids)  # negative: never a stream's id
        with contextlib.suppress(HostUnavailable):
            self._last[what] = self._ask(ask_id, Ask(what, ask_id)).value
        return self._last[what]

    def _ask(self, key: int, message):
        answers: queue.SimpleQueue = queue.SimpleQueue()
        with self._lock:
            self._answers[key] = answers
        try:
            self._send(message)
            answer = answers.get(timeout=ANSWER_TIMEOUT_S)
        except queue.Empty:
            raise HostUnavailable(f"the engine did not answer within {ANSWER_TIMEOUT_S:.0f} s") from None
        except OSError:
            raise HostUnavailable(f"the engine is broken: {ENGINE_GONE}") from None
        finally:
            with self._lock:
                self._answers.pop(key, None)
        if answer is None:
            raise HostUnavailable(f"the engine is broken: {ENGINE_GONE}")
        return answer

    def _cancel(self, stream_id: int) -> None:
        with contextlib.suppress(OSError):  # the engine is gone: the reader ends the stream
            self._send(Cancel(stream_id))

    def _send(self, message) -> None:
        with self._send_lock:
            self._conn.send(message)

    # ---- the engine's messages ----

    def _read(self) -> None:
        try:
            while True:
                message = self._conn.recv()
                if isinstance(message, StepOut):
                    self._apply(message)
                elif isinstance(message, (SubmitAnswer, Answer)):
                    key = message.stream_id if isinstance(message, SubmitAnswer) else message.ask_id
                    with self._lock:
                        answers = self._answers.get(key)
                    if answers is not None:
                        answers.put(message)
                else:
                    self.controls.put(message)
        except (EOFError, OSError):
            self._engine_gone()

    def _apply(self, step: StepOut) -> None:
        if step.broken is not None:
            self._latch(step.broken)  # before the streams it ended, so they read as "broke mid-reply"
        for out in step.streams:
            with self._lock:
                reply = self._replies.get(out.stream_id)
                if out.finished is not None:
                    self._replies.pop(out.stream_id, None)
            if reply is not None:
                reply.apply(out)

    def _latch(self, reason: str) -> None:
        if self._broken is None:
            self._broken = reason

    def _engine_gone(self) -> None:
        self._latch(ENGINE_GONE)
        with self._lock:
            replies, self._replies = list(self._replies.values()), {}
            waiting = list(self._answers.values())
        log.error("%s: ending %d streams; the front exits", ENGINE_GONE, len(replies))
        for reply in replies:
            reply.fail(ENGINE_GONE)
        for answers in waiting:
            answers.put(None)
        self.gone.set()
