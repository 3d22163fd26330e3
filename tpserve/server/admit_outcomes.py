"""What a plan's prompt passes report (tpserve/server/lane_admit.py): per job, a first token, an end,
or a wait for KV blocks. The scheduler applies them itself, one way (STYLE 14).
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
class BlockWait:
    """The job's next pass needs KV blocks that are not free: the chunking job waits a step; any
    other goes back to the front of its line (its lane closed) and is taken again when they are."""

    job: Job


Outcome = FirstToken | Ended | BlockWait
