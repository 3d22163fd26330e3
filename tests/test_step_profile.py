"""The step timers bench/step_profile.py reads: a reply's decode steps and their parts reach the file,
and a profiled host gives the very replies an unprofiled one gives."""

from __future__ import annotations

import json

from fake_backend import FakeBackend
from fake_replies import make_request, run_all
from fake_tokens import EOS_IDS, fake_detokenize

from tpserve.ranks.step_profile import NoProfile, StepProfile, profile_from_environment
from tpserve.server.lane_host import LaneHost


def test_a_profiled_host_counts_its_decode_steps_and_gives_the_same_replies(tmp_path):
    path = tmp_path / "steps.json"
    backend, profile = FakeBackend(num_lanes=4, batched=True), StepProfile(path)
    host = LaneHost(backend, detokenize=fake_detokenize, eos_ids=EOS_IDS, profile=profile)
    requests = [make_request([5 + i, 6, 7], 12, ignore_eos=True) for i in range(3)]
    streams = [host.submit(request) for request in requests]
    replies = run_all(host, streams)
    profile.flush()  # the daemon's leader flushes when it goes idle
    assert replies == [backend.solo_reply(r) for r in requests]
    totals = json.loads(path.read_text())
    # Three prompts in one pass (a step of its own), then 11 rounds for the rest of each reply's 12 tokens.
    assert totals["steps"]["prefill"] == 1
    assert totals["steps"]["decode"] == 11
    assert totals["lanes"]["decode"] == 33
    assert totals["parts"]["decode"]["tokens"][0] > 0
    assert totals["parts"]["decode"]["step"][0] >= totals["parts"]["decode"]["tokens"][0]


def test_the_timers_are_off_unless_the_environment_names_a_file(tmp_path):
    assert isinstance(profile_from_environment({}), NoProfile)
    assert isinstance(profile_from_environment({"TPSERVE_STEP_PROFILE": str(tmp_path / "x")}), StepProfile)
