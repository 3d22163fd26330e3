"""A step plan's one pass on the backend: the decode round's items, and the pass run with the prompts
beside the round (step_plan.py plans it; lane_scheduler.py applies what it samples).

When some rank refuses a prompt beside the round (ChunkRefused), nothing of that pass ran: the round
goes again alone and the scheduler then runs each prompt alone, so only the refused one fails. Any
other failure of a round breaks the engine.
"""

from __future__ import annotations

from tpserve.server.backend import Backend, BackendBroken, ChunkRefused, DecodeItem, PrefillItem, attempt
from tpserve.server.lane_job import Job
from tpserve.server.step_plan import StepPlan


def round_items(plan: StepPlan, live: list[Job]) -> list[DecodeItem]:
    """The round's item per stream: `live` holds the jobs of plan.rows, in order."""
    return [
        DecodeItem(
            rows.lane,
            rows.position,
            rows.token_id,
            job.request.sampling,
            rows.draft,
            rows.blocks,
            job.allowed_tokens(),
            job.counts,
        )
        for job, rows in zip(live, plan.rows)
    ]


def run_round(
    backend: Backend, items: list[DecodeItem], drafts, prompts: list[PrefillItem]
) -> tuple[list[list[int]], bool]:
    """(samples per item, then [token] per prompt that ended; whether the prompts were refused and
    the round went again alone, its samples alone)."""
    samples, error = _attempt_round(backend, items, drafts, prompts)
    refused = isinstance(error, ChunkRefused)
    if refused:  # nothing ran: the round goes again alone, then each prompt alone
        samples, error = _attempt_round(backend, items, drafts, [])
    if error is not None:
        raise BackendBroken(f"a decode round failed: {error!r}") from error
    return samples, refused


def _attempt_round(backend: Backend, items: list[DecodeItem], drafts, prompts: list[PrefillItem]):
    """(samples per item, then [token] per prompt that ended; the error)."""
    if any(drafts):
        return attempt(backend.decode_drafts, items, prompts)
    tokens, error = attempt(backend.decode, items, prompts)
    return (None if error is not None else [[token] for token in tokens]), error
