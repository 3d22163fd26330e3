"""Applies one wire message to this rank's engine: the same code on rank 0 and on the followers.

A prompt's first pass (a whole prompt, or its first chunk) is voted on before anything changes (an
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
from tpserve.ranks.wire_messages import Admit, Bundle, Idle, Mixed, Prefill, Release, Round, Stop, Verify


class VotedDown(Exception):
    """Some rank refused a voted message; no rank changed anything."""


def apply_message(
    engine: Engine, channel, msg, media: torch.Tensor | None = None, greedy: bool = False, listed=None
) -> torch.Tensor | None:
    """Returns the logits of a Prefill, Round or Verify on rank 0 (None elsewhere and for other kinds).

    `media`: on rank 0, the image features of a Prefill's media runs, in message order; `greedy`: a
    Round's argmax ids in place of its logits (rank 0's choice: the pass is the same on every rank);
    `listed`: a Round's rows' SamplingParams, for its shortlist in place of its logits (the same).
    Raises VotedDown when the ranks voted no.
    """
    if isinstance(msg, Bundle):  # a follower's: rank 0 applied all but the last as it sent them
        *first, last = msg.messages
        for inner in first:
            apply_message(engine, channel, inner)
        return apply_message(engine, channel, last, media, greedy, listed)
    if isinstance(msg, Admit):
        engine.admit(
            msg.lane, msg.blocks, msg.num_cached, msg.copy_from
        )  # rank 0 chose them: nothing to vote on
        return None
    if isinstance(msg, Prefill):
        spans = [(s.lane, s.start, s.token_ids, s.blocks) for s in msg.spans]
        if engine.first_pass(spans) and not channel.vote(engine.check(spans) and not engine.refuses(spans)):
            raise VotedDown("prefill refused by some rank")
        every_row = [s.every_row for s in msg.spans]
        rope = [s.rope for s in msg.spans] if any(s.rope for s in msg.spans) else None
        media_rows = [s.media_rows() for s in msg.spans] if any(s.media for s in msg.spans) else None
        return engine.forward(
            spans, every_row=every_row, media_rows=media_rows, media=media if media_rows else None, rope=rope
        )
    if isinstance(msg, Mixed):
        verify = isinstance(msg.round, Verify)
        steps = msg.round.spans if verify else msg.round.steps
        steps = [
            (s.lane, s.start, s.token_ids, s.blocks)
            if verify
            else (s.lane, s.position, (s.token_id,), s.blocks)
            for s in steps
        ]
        prompts = [(s.lane, s.start, s.token_ids, s.blocks) for s in msg.prefill.spans]
        engine.drop_unkept_drafts(steps)  # the same on every rank, whatever the vote: drafts it did not keep
        voted = engine.first_pass(prompts)
        if voted and not channel.vote(engine.check([*steps, *prompts]) and not engine.refuses(prompts)):
            raise VotedDown("a prompt beside a decode round refused by some rank")
        spans = msg.prefill.spans
        media_rows = [s.media_rows() for s in spans] if any(s.media for s in spans) else None
        return engine.mixed(
            steps,
            verify,
            prompts,
            media_rows,
            media if media_rows else None,
            prompt_rows=[s.every_row for s in spans],
            rope=[s.rope for s in spans] if any(s.rope for s in spans) else None,
        )
    if isinstance(msg, Round):
        steps = [(s.lane, s.position, (s.token_id,), s.blocks) for s in msg.steps]
        return engine.decode_round(steps, greedy=greedy, listed=listed)
    if isinstance(msg, Verify):
        return engine.verify([(s.lane, s.start, s.token_ids, s.blocks) for s in msg.spans])
    if isinstance(msg, Release):
        engine.release(msg.lane)
        return None
    if isinstance(msg, (Idle, Stop)):
        return None
    raise TypeError(f"no rule to apply {type(msg).__name__}")
