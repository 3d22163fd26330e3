"""A prompt whose images go in one pass (PromptImage.whole: Gemma 3's, whose image tokens see each
other) is never cut inside one: the long prompt's chunks on the fake backend, alone and beside a
decode round's token budget, end before an image they reach and take the rest of one they start
in; an image that may be cut (every other family's) is cut where the chunks fall, as before."""

from __future__ import annotations

from fake_backend import FakeBackend
from fake_replies import make_request, run_all
from fake_tokens import EOS_IDS, fake_detokenize

from tpserve.server.lane_host import LaneHost
from tpserve.server.lane_job import Job
from tpserve.server.requests import PromptImage

PROMPT = list(range(10, 40))  # 30 tokens
IMAGES = ((5, 6), (14, 7), (22, 3))  # (offset, tokens)


def with_images(whole: bool, max_tokens: int = 4):
    images = tuple(PromptImage(o, n, -1 - o, None, whole=whole) for o, n in IMAGES)
    return make_request(PROMPT, max_tokens, ignore_eos=True, images=images)


def chunk_ends(backend, skip: int = 0) -> list[int]:
    """Where each prompt pass ended, after the first `skip` passes (another prompt's)."""
    ends, at = [], 0
    for kind, num_tokens in [entry for entry in backend.timeline if entry[0] == "prefill"][skip:]:
        if kind == "prefill":
            at += num_tokens
            ends.append(at)
    return ends


def cuts_an_image(end: int) -> bool:
    return any(offset < end < offset + size for offset, size in IMAGES)


def test_chunks_never_end_inside_a_whole_image_and_the_reply_is_the_solo_runs():
    backend = FakeBackend(num_lanes=2, max_prefill_tokens=8)
    host = LaneHost(backend, detokenize=fake_detokenize, eos_ids=EOS_IDS)
    (reply,) = run_all(host, [host.submit(with_images(True))])
    ends = chunk_ends(backend)
    assert ends[-1] == len(PROMPT) and len(ends) > 3
    assert not any(cuts_an_image(end) for end in ends), ends
    assert reply == backend.solo_reply(with_images(True))
    backend.assert_clean()


def test_a_chunk_beside_a_decode_round_keeps_images_whole_too():
    backend = FakeBackend(num_lanes=2, max_prefill_tokens=8)
    host = LaneHost(backend, detokenize=fake_detokenize, eos_ids=EOS_IDS)
    neighbour = host.submit(make_request([1, 2, 3], 30, ignore_eos=True))
    host.step()
    long_prompt = host.submit(with_images(True))
    replies = run_all(host, [neighbour, long_prompt])
    ends = chunk_ends(backend, skip=1)  # the neighbour's prompt first
    assert ends[-1] == len(PROMPT)
    assert not any(cuts_an_image(end) for end in ends), ends
    assert replies[1] == backend.solo_reply(with_images(True))


def test_images_that_may_be_cut_are_cut_where_the_chunks_fall():
    backend = FakeBackend(num_lanes=2, max_prefill_tokens=8)
    host = LaneHost(backend, detokenize=fake_detokenize, eos_ids=EOS_IDS)
    run_all(host, [host.submit(with_images(False))])
    assert chunk_ends(backend) == [8, 16, 24, 30]


def test_a_pass_starting_inside_an_image_takes_the_rest_of_it():
    job = Job(with_images(True), reserve=64, detokenize=None, submitted_at=0.0, cancel=lambda job: None)
    assert job.chunk_end(0, 8) == 5  # before the first image
    assert job.chunk_end(5, 8) == 13  # the image whole, then text
    assert job.chunk_end(8, 8) == 14  # after a cached prefix inside it: on, to before the second
    assert job.chunk_end(8, 2) == 11  # the rest of it, past a small budget
    assert job.chunk_end(13, 4) == 14  # before the second
    assert job.chunk_end(13, 8) == 21  # the second whole, to its last token
    assert job.chunk_end(15, 2) == 21  # past a small budget, to the image's end
    assert job.chunk_end(25, 8) == 30
