"""Applies one wire message to this rank's engine: the same code on rank 0 and on the followers.

Messages whose application can fail are voted on before anything changes (an all-reduce of an
ok flag on the control channel), so a refusal anywhere leaves every rank as it was. A prefill
votes on its checks before the forward pass: once the pass's collectives start, a failure cannot
be rolled back and latches the engine broken instead.
"""

from __future__ import annotations

import torch

from tpserve.ranks.engine import Engine
from tpserve.ranks.wire import Admit, Evict, Idle, Keep, Prefill, Release, Restore, Round, Stop, Verify


class Refused(Exception):
    """Some rank refused a voted message; no rank changed anything."""


def apply(engine: Engine, channel, msg, media: torch.Tensor | None = None) -> torch.Tensor | None:
    """Returns the logits of a Prefill, Round or Verify on rank 0 (None elsewhere and for other kinds).

    `media`: on rank 0, the image features of a Prefill's media runs, in message order.
    Raises Refused when the ranks voted no.
    """
    if isinstance(msg, Admit):
        ok = engine.admit(msg.lane, msg.reserve_tokens)
        if not channel.vote(ok):
            if ok:
                engine.release(msg.lane)
            raise Refused(f"lane {msg.lane}: no room for {msg.reserve_tokens} tokens on some rank")
        return None
    if isinstance(msg, Prefill):
        spans = [(s.lane, s.start, s.token_ids) for s in msg.spans]
        if not channel.vote(engine.check(spans) and not engine.refuses(spans)):
            raise Refused("prefill refused by some rank")
        if not any(s.media for s in msg.spans):
            return engine.forward(spans)
        return engine.forward(spans, media_rows=[s.media_rows() for s in msg.spans], media=media)
    if isinstance(msg, Round):
        return engine.forward([(s.lane, s.position, (s.token_id,)) for s in msg.steps], cut=True)
    if isinstance(msg, Verify):
        return engine.forward([(s.lane, s.start, s.token_ids) for s in msg.spans], every_row=True, cut=True)
    if isinstance(msg, Release):
        engine.release(msg.lane)
        return None
    if isinstance(msg, Keep):
        ok = engine.keep(msg.lane, msg.num_tokens, msg.entry_id)
        if not channel.vote(ok):
            if ok:
                engine.evict(msg.entry_id)
            raise Refused(f"cache entry {msg.entry_id}: keep refused by some rank")
        return None
    if isinstance(msg, Restore):
        before = engine.lengths([msg.lane])
        ok = engine.restore(msg.lane, msg.entry_id, msg.num_tokens)
        if not channel.vote(ok):
            if ok:
                engine.rewind(before)
            raise Refused(f"cache entry {msg.entry_id}: restore refused by some rank")
        return None
    if isinstance(msg, Evict):
        engine.evict(msg.entry_id)
        return None
    if isinstance(msg, (Idle, Stop)):
        return None
    raise TypeError(f"no rule to apply {type(msg).__name__}")
