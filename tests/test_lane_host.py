"""The lane host on the fake backend: order, continuous batching, stop conditions, cancels, refusals.

Every reply is checked against its own solo run (a fresh fake and host running it alone); the fake's
tokens depend on each lane's whole history, so any slip in positions, lanes or rollback shows.
"""

from __future__ import annotations

import pytest
from fake_backend import FakeBackend
from fake_replies import make_request, read_reply, run_all, step_until_finished
from fake_tokens import EOS_ID, EOS_IDS, PIECES, fake_detokenize

from tpserve.server.lane_host import LaneHost
from tpserve.server.requests import Finished, HostUnavailable, Prefilled, QueueFull, TokenDelta


def make_host(backend, **kwargs):
    return LaneHost(backend, detokenize=fake_detokenize, eos_ids=EOS_IDS, **kwargs)


def finish_order(host, streams, max_steps=2000):
    """Step until every stream finished; the stream indices in the order they finished."""
    order = []
    for _ in range(max_steps):
        for index, stream in enumerate(streams):
            if stream.finished is not None and index not in order:
                order.append(index)
        if len(order) == len(streams):
            return order
        host.step()
    raise AssertionError("streams did not finish")


def long_request(first, max_tokens=20, **kwargs):
    return make_request([first, first + 1, first + 2], max_tokens, ignore_eos=True, **kwargs)


def test_foreground_runs_before_background_each_in_arrival_order():
    backend = FakeBackend(num_lanes=1)
    host = make_host(backend)
    requests = [
        long_request(1, 4, background=True),
        long_request(2, 4),
        long_request(3, 4, background=True),
        long_request(4, 4),
    ]
    streams = [host.submit(request) for request in requests]
    assert finish_order(host, streams) == [1, 3, 0, 2]
    assert [read_reply(s) for s in streams] == [backend.solo_reply(r) for r in requests]
    backend.assert_clean()


def test_a_stream_joins_a_running_one_between_rounds_and_both_replies_equal_solo():
    backend = FakeBackend(num_lanes=2)
    host = make_host(backend)
    first = long_request(1, 30)
    first_stream = host.submit(first)
    for _ in range(5):
        host.step()
    second = make_request([7, 8], 10, seed=3, ignore_eos=True)
    second_stream = host.submit(second)
    order = finish_order(host, [first_stream, second_stream])
    assert order == [1, 0], "the second stream ran beside the first, not after it"
    assert 2 in backend.decode_sizes
    assert read_reply(first_stream) == backend.solo_reply(first)
    assert read_reply(second_stream) == backend.solo_reply(second)
    backend.assert_clean()


def test_eos_ends_the_reply_its_id_sent_without_text_and_ignore_eos_runs_past_it():
    backend = FakeBackend()
    host = make_host(backend)
    # Prompt [1, 2, 3] meets EOS at its 5th token on the fake (greedy).
    (reply,) = run_all(host, [host.submit(make_request([1, 2, 3], 30))])
    assert reply.reason == "stop"
    # The EOS id is the last of the reply's ids (the tokens usage counts); its text is never sent.
    assert reply.token_ids[-1] == EOS_ID and EOS_ID not in reply.token_ids[:-1]
    assert reply.finished.usage.completion_tokens == len(reply.token_ids)
    assert reply.text == fake_detokenize(reply.token_ids[:-1])
    (past,) = run_all(host, [host.submit(make_request([1, 2, 3], 30, ignore_eos=True))])
    assert past.reason == "length" and len(past.token_ids) == 30
    assert past.token_ids[: len(reply.token_ids)] == reply.token_ids
    backend.assert_clean()


def test_max_tokens_ends_the_reply_with_length():
    backend = FakeBackend()
    host = make_host(backend)
    (reply,) = run_all(host, [host.submit(long_request(2, 7))])
    assert reply.reason == "length"
    assert len(reply.token_ids) == 7 and reply.finished.usage.completion_tokens == 7
    assert reply.finished.usage.prompt_tokens == 3
    backend.assert_clean()


def test_a_stop_string_across_a_token_boundary_ends_the_reply_and_is_never_sent():
    backend = FakeBackend()
    full = backend.solo_reply(long_request(2, 12))
    stop = full.text[3:6]  # the second letter of token 1 and all of token 2 (pieces are two letters)
    assert full.text.find(stop) == 3
    host = make_host(backend)
    (reply,) = run_all(host, [host.submit(long_request(2, 12, stop=(stop, "zz")))])
    assert reply.reason == "stop"
    assert reply.text == full.text[:3]
    # Token 1 straddles the stop: sent, its text cut; token 2 (all stop string) is sent with no text.
    assert reply.token_ids == full.token_ids[:3]
    assert reply.finished.usage.completion_tokens == 3
    backend.assert_clean()


def test_text_that_might_start_a_stop_string_is_held_then_released():
    backend = FakeBackend()
    full = backend.solo_reply(long_request(2, 6))
    held_piece = PIECES[full.token_ids[2]]
    host = make_host(backend)
    stream = host.submit(long_request(2, 6, stop=(held_piece + "zz",)))
    step_until_finished(host, [stream])
    deltas = [event for event in stream.events(timeout_each=0) if isinstance(event, TokenDelta)]
    joint = [delta for delta in deltas if full.token_ids[2] in delta.token_ids]
    assert joint[0].token_ids == full.token_ids[2:4], "token 2 waited for token 3"
    assert joint[0].text == fake_detokenize(full.token_ids[2:4])
    assert "".join(delta.text for delta in deltas) == full.text
    assert stream.finished.reason == "length"
    backend.assert_clean()


def test_cancel_of_a_queued_request_ends_it_at_once():
    backend = FakeBackend(num_lanes=1)
    host = make_host(backend)
    running = host.submit(long_request(1, 10))
    host.step()
    waiting = host.submit(long_request(2, 10))
    waiting.cancel()
    assert waiting.finished is not None and waiting.finished.reason == "cancelled"
    assert [type(event) for event in waiting.events(timeout_each=0)] == [Finished]
    assert host.stats().queued == 0
    (reply,) = run_all(host, [running])
    assert reply == backend.solo_reply(long_request(1, 10))
    assert backend.num_opens == 1, "the cancelled request never got a lane"
    backend.assert_clean()


def test_cancel_during_a_chunked_prefill_frees_the_lane_at_the_next_boundary():
    backend = FakeBackend(num_lanes=2, max_prefill_tokens=8)
    host = make_host(backend)
    neighbour = host.submit(long_request(1, 12))
    host.step()
    long_prompt = host.submit(make_request(list(range(1, 31)), 5))  # 30 tokens: 4 chunks
    host.step()
    assert backend.num_prefills == 2 and len(backend.lanes) == 2  # neighbour's prompt, first chunk
    long_prompt.cancel()
    assert long_prompt.finished is None, "cancel only leaves a note; the scheduler ends it"
    host.step()
    assert long_prompt.finished.reason == "cancelled"
    assert backend.num_prefills == 2 and len(backend.lanes) == 1
    (reply,) = run_all(host, [neighbour])
    assert reply == backend.solo_reply(long_request(1, 12))
    backend.assert_clean()


def test_cancel_of_a_live_stream_keeps_what_was_sent_and_frees_its_lane():
    backend = FakeBackend()
    host = make_host(backend)
    request = long_request(3, 40)
    stream = host.submit(request)
    for _ in range(6):
        host.step()
    stream.cancel()
    host.step()
    reply = read_reply(stream)
    assert reply.reason == "cancelled"
    solo = backend.solo_reply(request)
    assert 0 < len(reply.token_ids) < 40
    assert reply.token_ids == solo.token_ids[: len(reply.token_ids)]
    assert not host.step(), "nothing left to do"
    backend.assert_clean()


def test_a_long_prompt_prefills_in_chunks_between_decode_rounds():
    backend = FakeBackend(num_lanes=2, max_prefill_tokens=8)
    host = make_host(backend)
    short = long_request(1, 12)
    long_prompt = make_request(list(range(2, 32)), 6, seed=5)
    streams = [host.submit(short)]
    host.step()
    streams.append(host.submit(long_prompt))
    replies = run_all(host, streams)
    assert backend.num_prefills == 1 + 4
    assert backend.decode_sizes[:4] == [1, 1, 1, 1], "the live stream kept decoding during the chunks"
    assert replies == [backend.solo_reply(short), backend.solo_reply(long_prompt)]
    backend.assert_clean()


def test_background_stream_yields_its_lane_and_resumes_without_resending():
    backend = FakeBackend(num_lanes=2)
    host = make_host(backend)
    older = long_request(1, 20, background=True)
    newer = long_request(5, 20, background=True, seed=9)
    urgent = long_request(9, 5)
    streams = [host.submit(older), host.submit(newer)]
    for _ in range(4):
        host.step()
    streams.append(host.submit(urgent))
    order = finish_order(host, streams)
    assert order[0] == 2, "the foreground request did not wait for a background one to end"
    assert backend.num_opens == 4, "the newer background stream yielded once and came back"
    replies = [read_reply(s) for s in streams]
    assert replies == [backend.solo_reply(r) for r in (older, newer, urgent)]
    assert [reply.num_prefilled_events for reply in replies] == [1, 1, 1]
    backend.assert_clean()


def test_background_stream_yields_room_a_foreground_request_needs():
    # Two lanes, but room for one 23-token stream plus a little.
    backend = FakeBackend(num_lanes=2, room=30)
    host = make_host(backend)
    background = long_request(1, 20, background=True)
    urgent = long_request(4, 4)
    streams = [host.submit(background)]
    host.step()
    host.step()
    streams.append(host.submit(urgent))
    assert finish_order(host, streams) == [1, 0]
    assert [read_reply(s) for s in streams] == [backend.solo_reply(background), backend.solo_reply(urgent)]
    backend.assert_clean()


def test_a_failed_prefill_fails_that_request_alone():
    backend = FakeBackend(num_lanes=2)
    backend.poisoned_prompts = {6}
    host = make_host(backend)
    requests = [long_request(1, 8), long_request(6, 8), long_request(3, 8), long_request(4, 8, seed=1)]
    replies = run_all(host, [host.submit(r) for r in requests])
    assert replies[1].reason == "error" and "prefill failed" in replies[1].finished.error
    assert replies[1].num_prefilled_events == 0
    for index in (0, 2, 3):
        assert replies[index] == backend.solo_reply(requests[index])
    assert not host.broken
    backend.assert_clean()


def test_a_full_queue_refuses_at_once():
    backend = FakeBackend(num_lanes=1)
    host = make_host(backend, queue_size=2)
    streams = [host.submit(long_request(1, 3)), host.submit(long_request(2, 3))]
    with pytest.raises(QueueFull):
        host.submit(long_request(3, 3))
    host.step()  # the first request takes the lane and leaves the queue
    streams.append(host.submit(long_request(3, 3)))
    assert all(reply.reason == "length" for reply in run_all(host, streams))
    backend.assert_clean()


def test_a_request_that_can_never_fit_fails_at_once_and_one_over_the_context_is_refused():
    backend = FakeBackend(room=40, context_size=64)
    host = make_host(backend)
    stream = host.submit(make_request([1, 2, 3], 50))
    assert stream.finished.reason == "error"
    assert "53 tokens" in stream.finished.error and "40" in stream.finished.error
    with pytest.raises(ValueError, match=r"3 tokens\).*62\).*64 tokens"):
        host.submit(make_request([1, 2, 3], 62))
    assert not host.step()
    assert backend.num_opens == 0


def test_a_broken_engine_ends_every_stream_with_an_error_and_refuses_new_work():
    backend = FakeBackend(num_lanes=2)
    backend.break_after_decodes = 3
    calls = []
    host = make_host(backend, on_broken=calls.append)
    streams = [host.submit(long_request(i, 20)) for i in (1, 2, 3)]
    for _ in range(10):
        host.step()
    replies = [read_reply(s) for s in streams]
    assert [reply.reason for reply in replies] == ["error"] * 3
    assert all(reply.finished.error.startswith("engine broken: ") for reply in replies)
    assert host.broken and len(calls) == 1 and "rank was lost" in calls[0]
    with pytest.raises(HostUnavailable, match="broken"):
        host.submit(long_request(4, 5))
    assert backend.num_calls_after_broken == 0, "the host left the broken engine alone"
    assert host.stats().queued == 0 and host.stats().lanes_busy == 0


def test_stop_lets_live_streams_finish_within_the_grace_and_cancels_the_queue():
    backend = FakeBackend(num_lanes=2)
    host = make_host(backend)
    live = [host.submit(long_request(1, 6)), host.submit(long_request(2, 6))]
    host.step()  # the first prompt alone (this backend runs one prompt a pass)
    host.step()  # its decode round, the second prompt riding in it
    queued = host.submit(long_request(3, 6))
    host.stop(grace_s=10.0)
    assert [read_reply(s).reason for s in live] == ["length", "length"]
    assert read_reply(queued).reason == "cancelled"
    with pytest.raises(HostUnavailable, match="stopping"):
        host.submit(long_request(4, 6))
    backend.assert_clean()


def test_stop_with_no_grace_cancels_live_streams_and_returns_their_lanes():
    backend = FakeBackend(num_lanes=2, max_prefill_tokens=4)
    host = make_host(backend)
    streams = [host.submit(long_request(1, 50)), host.submit(make_request(list(range(1, 20)), 5))]
    host.step()
    host.stop(grace_s=0.0)
    assert [read_reply(s).reason for s in streams] == ["cancelled", "cancelled"]
    backend.assert_clean()


def test_events_arrive_in_order_with_usage_timed_by_the_clock():
    ticks = iter(range(1000))
    backend = FakeBackend()
    host = make_host(backend, clock=lambda: float(next(ticks)))
    stream = host.submit(long_request(2, 3))
    step_until_finished(host, [stream])
    events = list(stream.events(timeout_each=0))
    assert isinstance(events[0], Prefilled) and events[0].cached_tokens == 0
    assert all(isinstance(event, TokenDelta) for event in events[1:-1])
    usage = events[-1].usage
    assert usage.time_to_first_token_s > 0 and usage.total_s > usage.time_to_first_token_s
    assert stream.next_event(timeout=0) is None, "nothing after Finished"


def test_stats_report_queue_lanes_and_room():
    backend = FakeBackend(num_lanes=1, room=100, block_size=4)
    host = make_host(backend)
    streams = [host.submit(long_request(1, 10)), host.submit(long_request(2, 10))]
    host.step()  # the 3-token prompt, its step's one pass: one block of 4 tokens (position 3 too)
    stats = host.stats()
    assert (stats.queued, stats.lanes_busy, stats.room_used, stats.num_lanes, stats.room) == (1, 1, 4, 1, 100)
    host.step()  # a decode round at position 3, in that block
    assert host.stats().room_used == 4
    host.step()  # position 4: a second block
    assert host.stats().room_used == 8
    run_all(host, streams)
    assert host.stats().room_used == 0 and host.stats().lanes_busy == 0


def test_stop_token_ids_end_the_reply_ignore_eos_or_not_their_id_sent_without_text():
    backend = FakeBackend()
    full = backend.solo_reply(long_request(2, 12))
    stop_id = full.token_ids[3]
    first = full.token_ids.index(stop_id)
    host = make_host(backend)
    (reply,) = run_all(host, [host.submit(long_request(2, 12, stop_token_ids=(stop_id,)))])
    assert reply.reason == "stop" and reply.token_ids == full.token_ids[: first + 1]
    assert reply.text == fake_detokenize(full.token_ids[:first])
    assert reply.finished.usage.completion_tokens == first + 1
    backend.assert_clean()


def test_include_stop_str_in_output_sends_the_stop_string_and_nothing_after():
    backend = FakeBackend()
    full = backend.solo_reply(long_request(2, 12))
    stop = full.text[3:6]
    host = make_host(backend)
    (reply,) = run_all(
        host, [host.submit(long_request(2, 12, stop=(stop,), include_stop_str_in_output=True))]
    )
    assert reply.reason == "stop" and reply.text == full.text[:6]
    backend.assert_clean()
