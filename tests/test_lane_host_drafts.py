"""Draft tokens: a decode round checks prompt-lookup guesses, and no reply changes.

The fake model here repeats its history with a fixed period (greedy), so prompt lookup guesses
right; sampled streams draw noise, so their guesses mostly fail. Either way every reply must equal
the reply of plain decoding (a fake without drafts), token for token, and end where it would:
max_tokens, EOS, stop strings and cancels inside a run of accepted drafts included.
"""

from __future__ import annotations

from fake_backend import FakeBackend
from fake_replies import make_request, read_reply, run_all
from fake_tokens import EOS_IDS, fake_detokenize

from tpserve.server.drafts import propose
from tpserve.server.lane_host import LaneHost

PERIOD = 5
PROMPT = (3, 14, 15, 9, 26, 5, 35, 8, 9, 7)


def host_with_drafts(backend, max_draft_tokens=15):
    return LaneHost(backend, detokenize=fake_detokenize, eos_ids=EOS_IDS, max_draft_tokens=max_draft_tokens)


def test_a_repeating_stream_takes_many_tokens_a_round_and_replies_as_plain_decoding():
    backend = FakeBackend(repeat_period=PERIOD)
    request = make_request(PROMPT, 40, ignore_eos=True)
    host = host_with_drafts(backend)
    (reply,) = run_all(host, [host.submit(request)])
    assert reply == backend.solo_reply(request) and reply.reason == "length"
    assert len(reply.token_ids) == 40
    # 39 tokens after the first: plain decoding takes 39 rounds, drafts of up to 15 take 3.
    assert backend.num_verifies + backend.num_decodes <= 4
    assert host.drafter.num_accepted >= 30
    backend.assert_clean()


def test_wrong_drafts_are_dropped_from_the_first_mismatch_on():
    # The repeating model breaks its pattern every 7th position: prompt lookup guesses wrong there,
    # and the reply must still be plain decoding's, token for token.
    backend = FakeBackend(repeat_period=PERIOD, break_period=7, num_lanes=2)
    requests = [make_request(PROMPT, 60, ignore_eos=True), make_request(PROMPT[3:], 45, ignore_eos=True)]
    host = host_with_drafts(backend)
    replies = run_all(host, [host.submit(request) for request in requests])
    assert replies == [backend.solo_reply(request) for request in requests]
    drafter = host.drafter
    assert 0 < drafter.num_accepted < drafter.num_drafted  # some guesses kept, some rejected
    backend.assert_clean()


def test_mixed_streams_share_the_rows_and_every_reply_is_plain_decodings():
    backend = FakeBackend(repeat_period=PERIOD, num_lanes=4)
    requests = [
        make_request(PROMPT, 30, ignore_eos=True),
        make_request(PROMPT[::-1], 25, ignore_eos=True, seed=4),  # sampled: guesses mostly fail
        make_request((1, 2, 3, 4, 5, 6), 17, ignore_eos=True),
        make_request((9, 8, 7, 6, 5, 4, 3), 9),  # may meet EOS inside a run of drafts
    ]
    host = host_with_drafts(backend)
    replies = run_all(host, [host.submit(request) for request in requests])
    assert replies == [backend.solo_reply(request) for request in requests]
    rows = [size for kind, size in backend.timeline if kind == "verify"]
    assert rows and max(rows) <= 16, "a round feeds at most the 16 rows a product is padded to"
    backend.assert_clean()


def test_a_stream_whose_guesses_keep_failing_drafts_less_and_a_repeating_one_more():
    # Checking a draft costs its rows. The model breaks its pattern every 3rd position, so prompt
    # lookup keeps guessing wrong: its reach halves and soon rests (a probing token now and then)
    # instead of feeding 7 wrong rows a round (a fixed length wasted 238 here). The repeating model's
    # stream drafts the most it may.
    backend = FakeBackend(repeat_period=PERIOD, break_period=3)
    breaking = make_request(PROMPT, 120, ignore_eos=True)
    host = host_with_drafts(backend, max_draft_tokens=7)
    (reply,) = run_all(host, [host.submit(breaking)])
    assert reply == backend.solo_reply(breaking)
    drafter = host.drafter
    assert drafter.num_drafted - drafter.num_accepted <= 119 // 4, vars(drafter)
    backend = FakeBackend(repeat_period=PERIOD)
    repeating = make_request(PROMPT, 60, ignore_eos=True)
    host = host_with_drafts(backend, max_draft_tokens=7)
    (reply,) = run_all(host, [host.submit(repeating)])
    assert reply == backend.solo_reply(repeating)
    assert max(size for kind, size in backend.timeline if kind == "verify") == 8, "7 drafts and its token"
    backend.assert_clean()


def test_a_stop_string_inside_accepted_drafts_ends_the_reply_where_plain_decoding_does():
    backend = FakeBackend(repeat_period=PERIOD)
    plain = backend.solo_reply(make_request(PROMPT, 30, ignore_eos=True))
    stop = plain.text[12:16]  # text some accepted run will hold
    request = make_request(PROMPT, 30, ignore_eos=True, stop=(stop,))
    host = host_with_drafts(backend)
    (reply,) = run_all(host, [host.submit(request)])
    assert reply == backend.solo_reply(request) and reply.reason == "stop"
    assert stop not in reply.text
    backend.assert_clean()


def test_a_cancel_between_rounds_frees_the_lane_after_drafts():
    backend = FakeBackend(repeat_period=PERIOD)
    host = host_with_drafts(backend)
    stream = host.submit(make_request(PROMPT, 200, ignore_eos=True))
    for _ in range(3):
        host.step()
    stream.cancel()
    host.step()
    assert read_reply(stream).reason == "cancelled"
    assert backend.lanes == {}
    backend.assert_clean()


def test_drafts_off_or_a_backend_without_them_decodes_plainly():
    backend = FakeBackend(repeat_period=PERIOD)
    request = make_request(PROMPT, 20, ignore_eos=True)
    host = host_with_drafts(backend, max_draft_tokens=0)
    (reply,) = run_all(host, [host.submit(request)])
    assert reply == backend.solo_reply(request)
    assert backend.num_verifies == 0 and backend.num_decodes == 19


def test_prompt_lookup_returns_what_followed_the_latest_earlier_occurrence():
    assert propose([1, 2, 3, 4, 5, 1, 2, 3], 4) == (4, 5, 1, 2)
    assert propose([1, 2, 9, 1, 2, 7, 1, 2], 2) == (7, 1)  # the latest occurrence wins
    assert propose([7, 8, 7, 8, 7, 8], 5) == (7, 8, 7, 8, 7)  # carried on past the history's end
    assert propose([1, 2, 3, 4, 5, 6], 4) == ()
    assert propose([1, 2, 3, 1, 2, 3], 0) == ()
    # Whole tokens only: a byte pattern spanning two tokens is no match.
    assert propose([256, 1, 0, 0, 1], 3) == ()
