"""The HTTP readers' wake-ups (tpserve/server/http_relay.py Wakeups): marks from other threads set
every marked reader's event on the loop, one call into the loop for marks that come together, and a
mark after a drain is never lost."""

from __future__ import annotations

import asyncio
import threading

from tpserve.server.http_relay import Wakeups


def test_marks_from_threads_set_every_event_and_a_later_mark_wakes_again():
    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        calls = 0
        original = loop.call_soon_threadsafe

        def counting(*args):
            nonlocal calls
            calls += 1
            return original(*args)

        loop.call_soon_threadsafe = counting  # how often the putting threads reach into the loop
        wakeups = Wakeups(loop)
        events = [asyncio.Event() for _ in range(16)]
        # As a step puts its tokens: one thread marks every reader before the loop runs again.
        putter = threading.Thread(target=lambda: [wakeups.mark(event) for event in events])
        putter.start()
        putter.join()
        await asyncio.wait_for(asyncio.gather(*(event.wait() for event in events)), 5)
        assert calls == 1
        for event in events:
            event.clear()
        late = threading.Thread(target=wakeups.mark, args=(events[3],))
        late.start()
        late.join()
        await asyncio.wait_for(events[3].wait(), 5)
        assert calls == 2 and not any(event.is_set() for i, event in enumerate(events) if i != 3)

    asyncio.run(scenario())


def test_a_mark_after_the_loop_closed_is_dropped():
    loop = asyncio.new_event_loop()
    wakeups = Wakeups(loop)
    loop.close()
    wakeups.mark(asyncio.Event())  # the putting thread goes on: no reader is left to wake
