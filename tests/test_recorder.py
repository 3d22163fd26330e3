"""--record: recording changes no reply, and a stream's record is the same whether its prompt was
prefilled alone or in a joint pass (so batched and solo runs compare file by file)."""

from __future__ import annotations

import json

import pytest
from fake_backend import FakeBackend
from fake_replies import make_request, run_all
from fake_tokens import EOS_IDS, fake_detokenize

from tpserve.server.lane_host import LaneHost
from tpserve.server.recorder import RecordingBackend

FAKE_SHAPES = {
    "batched": {"batched": True},
    "pass-too-big": {"batched": True, "max_batch_streams": 2},
    "unbatched": {},
}


def requests_from(firsts, max_tokens=6):
    return [
        make_request(
            [first, first + 1, first + 3], max_tokens, ignore_eos=True, seed=None if i % 2 else 10 + i
        )
        for i, first in enumerate(firsts)
    ]


def run(requests, out_dir=None, batch_prefill=True, **shape):
    backend = FakeBackend(**shape)
    wrapped = backend if out_dir is None else RecordingBackend(backend, out_dir)
    host = LaneHost(wrapped, detokenize=fake_detokenize, eos_ids=EOS_IDS, batch_prefill=batch_prefill)
    replies = run_all(host, [host.submit(request) for request in requests])
    backend.assert_clean()
    return replies, backend


def records(out_dir):
    """Each stream file's lines, in open order."""
    return [path.read_text().splitlines() for path in sorted(out_dir.glob("stream-*.jsonl"))]


@pytest.mark.parametrize("shape", FAKE_SHAPES.values(), ids=FAKE_SHAPES.keys())
def test_recorded_and_unrecorded_replies_are_equal(tmp_path, shape):
    requests = requests_from([1, 5, 9, 13])
    recorded, _ = run(requests, tmp_path / "rec", **shape)
    plain, _ = run(requests, **shape)
    assert recorded == plain
    assert len(records(tmp_path / "rec")) == 4


@pytest.mark.parametrize("shape", FAKE_SHAPES.values(), ids=FAKE_SHAPES.keys())
def test_each_streams_record_equals_its_solo_record(tmp_path, shape):
    requests = requests_from([1, 5, 9, 13])
    _, backend = run(requests, tmp_path / "joint", **shape)
    if shape == FAKE_SHAPES["batched"]:
        assert backend.joint_passes == [4]
    joint = records(tmp_path / "joint")
    for index, request in enumerate(requests):
        run([request], tmp_path / f"solo-{index}", **shape)
        (solo,) = records(tmp_path / f"solo-{index}")
        assert joint[index] == solo, f"stream {index} recorded differently in the joint run"


def test_a_batched_recording_holds_the_same_files_as_an_unbatched_one(tmp_path):
    requests = requests_from([2, 6, 10, 14, 18])
    _, batched = run(requests, tmp_path / "batched", batched=True, num_lanes=5)
    _, unbatched = run(requests, tmp_path / "unbatched", batch_prefill=False, batched=True, num_lanes=5)
    assert batched.joint_passes == [5] and unbatched.joint_passes == []
    assert records(tmp_path / "batched") == records(tmp_path / "unbatched")


def test_a_record_holds_positions_tokens_and_features_step_by_step(tmp_path):
    request = make_request([4, 5, 6], 3, ignore_eos=True)
    (reply,), _ = run([request], tmp_path / "rec", max_prefill_tokens=2)
    (lines,) = records(tmp_path / "rec")
    steps = [json.loads(line) for line in lines]
    assert steps[0] == {"step": "open"}
    # The prompt ran in two chunks of at most 2 tokens: one line, as a whole pass writes it.
    prompt = steps[1]
    assert (prompt["start"], prompt["token_ids"], prompt["position"], prompt["fed"]) == (0, [4, 5, 6], 2, 6)
    assert [step["sampled"] for step in steps[1:]] == list(reply.token_ids)
    assert [(step["position"], step["fed"]) for step in steps[2:]] == list(zip((3, 4), reply.token_ids))
    assert all(len(step["features"]) == 3 for step in steps[1:])
    (whole,), _ = run([request], tmp_path / "whole", max_prefill_tokens=8)
    assert whole == reply
    assert records(tmp_path / "whole") == records(tmp_path / "rec")


def test_a_prompt_closed_before_its_end_writes_its_chunks_so_far(tmp_path):
    backend = FakeBackend(num_lanes=1, max_prefill_tokens=2)
    host = LaneHost(RecordingBackend(backend, tmp_path), detokenize=fake_detokenize, eos_ids=EOS_IDS)
    stream = host.submit(make_request([4, 5, 6, 7, 8], 3, ignore_eos=True))
    host.step()  # its first chunk, [4, 5]
    stream.cancel()
    run_all(host, [stream])
    (lines,) = records(tmp_path)
    assert [json.loads(line) for line in lines] == [
        {"step": "open"},
        {"step": "prefill", "start": 0, "token_ids": [4, 5]},
    ]
    backend.assert_clean()


def test_a_resumed_background_stream_continues_in_a_new_file(tmp_path):
    backend = FakeBackend(num_lanes=1)
    recorder = RecordingBackend(backend, tmp_path)
    host = LaneHost(recorder, detokenize=fake_detokenize, eos_ids=EOS_IDS)
    background = host.submit(make_request([1, 2], 8, ignore_eos=True, background=True))
    for _ in range(3):  # its prompt alone (its first token), then two decode rounds: three tokens
        host.step()
    urgent = host.submit(make_request([3, 4], 2, ignore_eos=True))
    run_all(host, [background, urgent])
    files = records(tmp_path)
    assert len(files) == 3, "background, urgent, background resumed"
    resumed_prefill = json.loads(files[2][1])
    assert resumed_prefill["token_ids"][:2] == [1, 2] and len(resumed_prefill["token_ids"]) == 2 + 3
    backend.assert_clean()


def test_recording_into_an_old_recording_is_refused(tmp_path):
    run(requests_from([1]), tmp_path)
    with pytest.raises(FileExistsError, match="already holds a recording"):
        RecordingBackend(FakeBackend(), tmp_path)


def test_recording_keeps_drafts_on_and_writes_what_plain_decoding_writes(tmp_path):
    # A model that repeats itself (period 5): prompt lookup guesses right, so drafts are kept.
    requests = [make_request((3, 14, 15, 9, 26, 5, 35), 30, ignore_eos=True), *requests_from([1, 5], 20)]
    plain = FakeBackend(repeat_period=5, num_lanes=3)
    plain_host = LaneHost(
        RecordingBackend(plain, tmp_path / "plain"), detokenize=fake_detokenize, eos_ids=EOS_IDS
    )
    plain_replies = run_all(plain_host, [plain_host.submit(request) for request in requests])
    drafted = FakeBackend(repeat_period=5, num_lanes=3)
    host = LaneHost(
        RecordingBackend(drafted, tmp_path / "drafts"),
        detokenize=fake_detokenize,
        eos_ids=EOS_IDS,
        max_draft_tokens=15,
    )
    replies = run_all(host, [host.submit(request) for request in requests])
    assert host.drafter is not None and host.drafter.num_accepted > 0 and drafted.num_verifies > 0
    assert replies == plain_replies
    assert records(tmp_path / "drafts") == records(tmp_path / "plain")
    drafted.assert_clean()


class NoIdle(FakeBackend):
    """A wrapper that forgot an operation of the protocol."""

    def __getattribute__(self, name):
        if name == "idle":
            raise AttributeError(name)
        return super().__getattribute__(name)


def test_a_backend_that_lacks_an_operation_is_refused_at_start_naming_it(tmp_path):
    with pytest.raises(TypeError, match="NoIdle is not a whole Backend .* it lacks idle"):
        LaneHost(NoIdle(), detokenize=fake_detokenize, eos_ids=EOS_IDS)
    with pytest.raises(TypeError, match="it lacks idle"):
        RecordingBackend(NoIdle(), tmp_path)


def test_a_backend_that_does_not_verify_drafts_serves_without_them_and_says_so(caplog):
    backend = FakeBackend(repeat_period=5, verifies_drafts=False)
    host = LaneHost(backend, detokenize=fake_detokenize, eos_ids=EOS_IDS, max_draft_tokens=15)
    assert host.drafter is None
    assert "draft tokens are off: FakeBackend does not verify drafts" in caplog.text
    request = make_request((3, 14, 15, 9, 26), 12, ignore_eos=True)
    assert run_all(host, [host.submit(request)]) == [backend.solo_reply(request)]
    backend.assert_clean()
