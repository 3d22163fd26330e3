"""Admission reports, the lane host applies: the refusals, failures and first tokens of a plan's
prompt pass come back as outcomes in the jobs' order, and no client hears of any of them before the host applies it."""

from __future__ import annotations

from fake_backend import FakeBackend
from fake_replies import make_request
from fake_tokens import fake_detokenize

from tpserve.server.admit_outcomes import Ended, FirstToken
from tpserve.server.lane_admit import Admission
from tpserve.server.lane_job import Job, reserve_for
from tpserve.server.lane_table import LaneTable


def make_job(backend, first):
    request = make_request([first, first + 2, first + 1], 4)
    reserve = reserve_for(request, backend.context_size)
    return Job(
        request, reserve=reserve, detokenize=fake_detokenize, submitted_at=0.0, cancel=lambda job: None
    )


def test_a_failed_prefill_is_returned_and_the_other_jobs_still_get_their_tokens():
    backend = FakeBackend(batched=True)
    backend.poisoned_prompts = {9}  # the third job's prefill fails (alone and in the joint pass)
    lanes = LaneTable(backend)
    admission = Admission(backend, lanes, batch_prefill=True)
    jobs = [make_job(backend, first) for first in (1, 5, 9, 13)]

    for job in jobs:  # what a plan's admission did (admit_plan.py): a lane each, its prompt booked
        lanes.open(job, 0)
        assert lanes.cover(job, len(job.feed_ids))
    outcomes = admission.run_prompts(jobs, admission.joint_prompts(jobs))  # the plan's prompt pass

    assert [(type(outcome), outcome.job) for outcome in outcomes] == [
        (FirstToken, jobs[0]),  # the joint pass failed: each prefilled alone, in order
        (FirstToken, jobs[1]),
        (Ended, jobs[2]),
        (FirstToken, jobs[3]),
    ]
    assert "prefill failed" in outcomes[2].error
    assert backend.failed_passes == [4]
    assert all(job.stream.next_events(timeout=0) == [] for job in jobs), "the host sends, not Admission"
    # The failed job still holds its lane: closing it is the host's part of applying its end.
    assert [job.lane for job in jobs] == [0, 1, 2, 3]
