"""Applies one wire message to this rank's engine: the same code on rank 0 and on the followers.

A step comes as one StepPlan: its lane changes, then its one pass (a round, prompts, or both). A
prompt's first pass (a whole prompt, or its first chunk) is voted on before anything changes (an
all-reduce of an ok flag on the control channel), so a refusal anywhere leaves every rank as it
was; the vote comes before the forward pass because once its collectives start, a failure cannot
be rolled back and latches the engine broken instead. A pass that opens no prompt (decode steps, a
long prompt's later chunks) rides on lanes every rank already holds identically and is not voted
on: at most one vote a step, none per chunk. Every rank derives whether a pass is voted from its
lanes (Engine.first_pass), which are the same on every rank by construction.
"""

from __future__ import annotations

import torch

from tpserve.ranks.engine import Engine
from tpserve.ranks.wire_messages import Admit, Idle, Prefill, Release, Round, StepPlan, Stop, Verify


class VotedDown(Exception):
    """Some rank refused a voted message; no rank changed anything."""


def apply_message(
    engine: Engine, channel, msg, media: torch.Tensor | None = None, greedy: bool = False, listed=None
) -> torch.Tensor | None:
    """Returns the logits of a StepPlan's pass on rank 0 (None elsewhere, and for other kinds).

    `media`: on rank 0, the image features of the plan's prompts' media runs, in message order;
    `greedy`: a plan that only decodes returns its round's argmax ids in place of its logits (rank
    0's choice: the pass is the same on every rank); `listed`: its rows' SamplingParams, for its
    shortlist in place of its logits (the same). Raises VotedDown when the ranks voted no.
    """
    if isinstance(msg, StepPlan):
        for change in msg.lanes:  # a follower's: rank 0 applied them as it made them
            apply_message(engine, channel, change)
        return _apply_pass(engine, channel, msg.round, msg.prefill, media, greedy, listed)
    if isinstance(msg, Admit):
        engine.admit(msg.lane, msg.blocks, msg.num_cached, msg.copy_from)  # rank 0 chose them: no vote
        return None
    if isinstance(msg, Release):
        engine.release(msg.lane)
        return None
    if isinstance(msg, (Idle, Stop)):
        return None
    raise TypeError(f"no rule to apply {type(msg).__name__}")


def _apply_pass(
    engine: Engine, channel, round_msg: Round | Verify | None, prefill: Prefill | None, media, greedy, listed
) -> torch.Tensor | None:
    """A plan's one forward pass: its round alone, its prompts alone, or both in one pass (none: a
    plan that only closes lanes). Voted on once when a prompt starts in it, after this rank checked
    every span of the pass, before the pass's collectives; a no anywhere changes nothing anywhere."""
    verify = isinstance(round_msg, Verify)
    if round_msg is None:
        steps = []
    elif verify:
        steps = [(s.lane, s.start, s.token_ids, s.blocks) for s in round_msg.spans]
    else:
        steps = [(s.lane, s.position, (s.token_id,), s.blocks) for s in round_msg.steps]
    if prefill is None:
        if round_msg is None:
            return None
        return engine.verify(steps) if verify else engine.decode_round(steps, greedy=greedy, listed=listed)
    spans = prefill.spans
    prompts = [(s.lane, s.start, s.token_ids, s.blocks) for s in spans]
    if steps:
        engine.drop_unkept_drafts(steps)  # the same on every rank, whatever the vote: drafts it did not keep
    if engine.first_pass(prompts) and not channel.vote(
        engine.check([*steps, *prompts]) and not engine.refuses(prompts)
    ):
        raise VotedDown("a prompt refused by some rank")
    media_rows = [s.media_rows() for s in spans] if any(s.media for s in spans) else None
    rope = [s.rope for s in spans] if any(s.rope for s in spans) else None
    every_row = [s.every_row for s in spans]
    if round_msg is None:
        return engine.forward(
            prompts,
            every_row=every_row,
            media_rows=media_rows,
            media=media if media_rows else None,
            rope=rope,
        )
    return engine.mixed(
        steps, verify, prompts, media_rows, media if media_rows else None, prompt_rows=every_row, rope=rope
    )
