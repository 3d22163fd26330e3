"""What admission and the plan's prompt passes report (tpserve/server/lane_admit.py): per job, a
first token, an end, a long prompt that goes in chunks, a wait for KV blocks, or a prompt riding in
this step's plan. The scheduler applies them itself, one way (STYLE 14).
"""

from __future__ import annotations

from dataclasses import dataclass

from tpserve.server.lane_job import Job


@dataclass(frozen=True)
class FirstToken:
    """The job's whole prompt is in its lane and the backend sampled its next token."""

    job: Job
    token: int


@dataclass(frozen=True)
class Ended:
    """The job ends here (cancelled, refused, or its prefill failed): close its lane if it holds one."""

    job: Job
    reason: str
    error: str | None = None


@dataclass(frozen=True)
class Chunking:
    """The job's long prompt goes in chunks from now on, one per step between decode rounds."""

    job: Job


@dataclass(frozen=True)
class BlockWait:
    """The job's next pass needs KV blocks that are not free: the chunking job waits a step; any
    other goes back to the front of its line (its lane closed) and is taken again when they are."""

    job: Job


@dataclass(frozen=True)
class Riding:
    """The job's whole prompt (its blocks booked) goes in this step's plan: beside the decode round,
    in the same pass, or with nothing decoding in the plan's prompt pass. The step stays one message
    and one pass; its first token comes with that pass's."""

    job: Job


Outcome = FirstToken | Ended | Chunking | BlockWait | Riding
