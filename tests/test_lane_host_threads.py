"""The lane host on its own thread: clients on many threads, cancels that never wait on the engine,
an idle scheduler that does not spin, and a stop that returns even when the engine is stuck."""

from __future__ import annotations

import threading
import time

from fake_backend import FakeBackend
from fake_replies import make_request, read_reply
from fake_tokens import EOS_IDS, fake_detokenize

from tpserve.server.lane_host import LaneHost
from tpserve.server.requests import Finished, TokenDelta

TIMEOUT_S = 30.0


def make_host(backend, **kwargs):
    return LaneHost(backend, detokenize=fake_detokenize, eos_ids=EOS_IDS, **kwargs)


class GatedFake(FakeBackend):
    """A fake whose decode rounds wait for the test to open a gate: an engine that is busy or stuck."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.gate = threading.Event()
        self.in_decode = threading.Event()

    def decode(self, items, prompts=()):
        self.in_decode.set()
        if not self.gate.wait(TIMEOUT_S):
            raise TimeoutError("the test never opened the gate")
        return super().decode(items, prompts)


def request_for(client, number):
    """Request 1 of each client is long (it gets cancelled mid-reply); the others are short."""
    first = 1 + (client * 3 + number) % 30
    max_tokens = 200 if number == 1 else 6 + number * 3
    return make_request([first, first + 2], max_tokens, ignore_eos=True, seed=client if number % 2 else None)


def test_many_client_threads_submit_read_and_cancel_and_the_idle_host_does_not_spin():
    backend = FakeBackend(num_lanes=3, batched=True)
    host = make_host(backend, queue_size=64)
    host.start()
    results: dict[tuple[int, int], tuple[str, tuple[int, ...]]] = {}
    errors: list[BaseException] = []

    def client(index):
        try:
            for number in range(3):
                stream = host.submit(request_for(index, number))
                token_ids: list[int] = []
                if number == 0 and index % 2:
                    stream.cancel()  # queued or just admitted
                cancel = number == 1
                for event in stream.events(timeout_each=TIMEOUT_S):
                    if isinstance(event, TokenDelta):
                        token_ids += event.token_ids
                        if cancel:
                            stream.cancel()
                    elif isinstance(event, Finished):
                        results[index, number] = (event.reason, tuple(token_ids))
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=client, args=(index,)) for index in range(8)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + TIMEOUT_S
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    assert not any(thread.is_alive() for thread in threads), "a client waited forever"
    assert errors == []
    assert len(results) == 24
    num_cancelled = 0
    for (index, number), (reason, token_ids) in results.items():
        solo = backend.solo_reply(request_for(index, number))
        if reason == "cancelled":
            num_cancelled += 1
            assert token_ids == solo.token_ids[: len(token_ids)]
        else:
            assert (reason, token_ids) == (solo.reason, solo.token_ids)
    assert num_cancelled > 0

    time.sleep(0.2)
    cpu_before = time.process_time()
    time.sleep(1.0)
    assert time.process_time() - cpu_before < 0.1, "the idle scheduler spins"

    host.stop(grace_s=1.0)
    backend.assert_clean()


def test_submit_cancel_and_stats_never_wait_on_a_busy_engine():
    backend = GatedFake(num_lanes=2)
    host = make_host(backend)
    host.start()
    try:
        live = host.submit(make_request([1, 2], 20, ignore_eos=True))
        assert backend.in_decode.wait(TIMEOUT_S)
        queued = host.submit(make_request([3, 4], 5))
        assert host.stats().lanes_busy == 1
        queued.cancel()
        live.cancel()
        assert queued.finished.reason == "cancelled", "a queued request ends at once"
        assert live.finished is None, "a live one ends at the next boundary"
    finally:
        backend.gate.set()
    assert read_reply_within(live).reason == "cancelled"
    host.stop(grace_s=1.0)
    backend.assert_clean()


def read_reply_within(stream):
    deadline = time.monotonic() + TIMEOUT_S
    while stream.finished is None and time.monotonic() < deadline:
        time.sleep(0.01)
    return read_reply(stream)


def test_stop_returns_and_ends_every_stream_even_when_the_engine_is_stuck():
    backend = GatedFake(num_lanes=1)
    host = make_host(backend)
    host.start()
    streams = [host.submit(make_request([1, 2], 20, ignore_eos=True)), host.submit(make_request([3, 4], 5))]
    assert backend.in_decode.wait(TIMEOUT_S)
    host.stop(grace_s=0.2)  # returns although the engine never does
    assert [stream.finished.reason for stream in streams] == ["cancelled", "cancelled"]
    backend.gate.set()  # the engine comes back: the scheduler still returns its lane and ends
    deadline = time.monotonic() + TIMEOUT_S
    while backend.lanes and time.monotonic() < deadline:
        time.sleep(0.01)
    backend.assert_clean()


def test_a_broken_engine_wakes_every_waiting_client_with_an_error():
    backend = FakeBackend(num_lanes=2)
    backend.break_after_decodes = 4
    broken = threading.Event()
    host = make_host(backend, on_broken=lambda reason: broken.set())
    streams = [host.submit(make_request([i, i + 1], 30, ignore_eos=True)) for i in (1, 4, 7)]
    host.start()
    replies = [read_reply_within(stream) for stream in streams]
    assert [reply.reason for reply in replies] == ["error"] * 3
    assert broken.wait(TIMEOUT_S) and host.broken
    host.stop(grace_s=1.0)
    assert backend.num_calls_after_broken == 0


def test_a_job_cancelled_after_the_scheduler_chose_it_is_not_taken():
    """The scheduler chooses from a snapshot of the queue outside its lock (nothing of it runs under
    the lock): a cancel that lands between the choice and the take leaves the job out, and no job
    behind it jumps the queue."""
    backend = FakeBackend()
    host = make_host(backend)
    first = host.submit(make_request([5, 6], 4))
    second = host.submit(make_request([7, 8], 4))
    state = host._state
    head = state.peek_many(2)
    first.cancel()
    assert state.take_head(head) == []  # the chosen head is gone: nothing is taken out of order
    assert first.finished is not None and first.finished.reason == "cancelled"
    assert state.num_queued() == 1
    while second.finished is None:
        host.step()
    assert read_reply(second).reason == "length"
    backend.assert_clean()
