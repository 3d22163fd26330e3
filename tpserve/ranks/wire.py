"""The wire format: rank 0's typed messages (tpserve/ranks/wire_messages.py) <-> flat int64 tensors
that a broadcast can carry.

A message travels as a fixed head of HEAD_SIZE int64s,

    [MAGIC | WIRE_VERSION, kind, sequence number, payload size, payload[:INLINE_SIZE], zero padding]

followed, when the payload is longer than INLINE_SIZE, by an overflow of exactly the rest of the
payload. The head alone says how long the overflow is, so a follower always knows what to receive
next. Payloads are ints only; a tensor that is not a well-formed message raises WireError.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, fields

import torch

from tpserve.ranks.wire_messages import KINDS, LANE_CHANGES, Admit, Message, Prefill, Round, StepPlan, Verify
from tpserve.ranks.wire_spans import WireError, spans_from, spans_payload, steps_from, steps_payload

__all__ = [
    "HEAD_SIZE",
    "INLINE_SIZE",
    "MAX_PAYLOAD_SIZE",
    "WIRE_VERSION",
    "Head",
    "WireError",
    "decode",
    "encode",
    "read_head",
]

# 6: a span says whether every row's logits are wanted and carries its rope positions; 7: a Mixed
# pass carries any number of prompts; 8: only a prompt's first pass is voted on (tpserve/ranks/apply.py);
# 10: a span's rope positions end with the lane's delta after it (a video's time may pass its text);
# 11: a step is one StepPlan (its lanes, its round, its prompts), replacing Bundle and Mixed
WIRE_VERSION = 11
_MAGIC_MASK = ~0xFFFF
MAGIC = 0x7470736572760000  # "tpserv" in ASCII; the low 16 bits carry WIRE_VERSION
HEAD_SIZE = 128
_HEAD_FIELDS = 4  # magic|version, kind, seq, payload size
INLINE_SIZE = HEAD_SIZE - _HEAD_FIELDS  # a step that only decodes, over up to 30 lanes, needs no overflow
# Bounds what a corrupt head can make a follower allocate (128 MiB of int64s).
MAX_PAYLOAD_SIZE = 1 << 24
_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1
_PASSES = (Round, Verify, Prefill)  # a StepPlan's pass: a round, prompts, or both, in that order


@dataclass(frozen=True)
class Head:
    """What the fixed head says: the kind, the sequence number and how much overflow follows."""

    kind: int
    seq: int
    payload_size: int

    @property
    def overflow_size(self) -> int:
        return max(0, self.payload_size - INLINE_SIZE)


def encode(msg: Message, seq: int = 0) -> torch.Tensor:
    """The message as one int64 tensor: the head, then the overflow (if any). Shape [HEAD_SIZE + overflow]."""
    if type(msg) not in KINDS.values():
        raise WireError(f"cannot encode {type(msg).__name__}: not a wire message")
    if seq < 0:
        raise WireError(f"negative sequence number {seq}")
    payload = _payload(msg)
    if len(payload) > MAX_PAYLOAD_SIZE:
        raise WireError(f"{type(msg).__name__} payload of {len(payload)} ints exceeds {MAX_PAYLOAD_SIZE}")
    head = [MAGIC | WIRE_VERSION, msg.KIND, seq, len(payload)]
    inline = payload[:INLINE_SIZE]
    values = head + inline + [0] * (INLINE_SIZE - len(inline)) + payload[INLINE_SIZE:]
    try:
        checked = [_as_int64(value) for value in values]
    except (TypeError, OverflowError) as err:
        raise WireError(f"cannot encode {msg!r}: {err}") from None
    return torch.tensor(checked, dtype=torch.int64)


def read_head(head: torch.Tensor) -> Head:
    """Check and read a head (the first HEAD_SIZE values of an encoded message)."""
    _check_tensor(head)
    if head.numel() < HEAD_SIZE:
        raise WireError(f"a message head holds {HEAD_SIZE} ints, got {head.numel()}")
    magic_version, kind, seq, payload_size = head[:_HEAD_FIELDS].tolist()
    if magic_version & _MAGIC_MASK != MAGIC:
        raise WireError(f"bad magic {magic_version:#x}: not a tpserve wire message")
    if magic_version & 0xFFFF != WIRE_VERSION:
        raise WireError(f"wire version {magic_version & 0xFFFF}, this rank speaks {WIRE_VERSION}")
    if kind not in KINDS:
        raise WireError(f"unknown message kind {kind}")
    if seq < 0:
        raise WireError(f"negative sequence number {seq}")
    if not 0 <= payload_size <= MAX_PAYLOAD_SIZE:
        raise WireError(f"payload size {payload_size} outside 0..{MAX_PAYLOAD_SIZE}")
    return Head(kind, seq, payload_size)


def decode(tensor: torch.Tensor) -> Message:
    """The message an `encode` produced: head plus overflow, concatenated."""
    head = read_head(tensor)
    expected = HEAD_SIZE + head.overflow_size
    if tensor.numel() != expected:
        raise WireError(
            f"{KINDS[head.kind].__name__} with a payload of {head.payload_size} ints takes "
            f"{expected} ints on the wire, got {tensor.numel()}"
        )
    values = tensor.tolist()
    inline_end = _HEAD_FIELDS + min(head.payload_size, INLINE_SIZE)
    payload = values[_HEAD_FIELDS:inline_end] + values[HEAD_SIZE:]
    return _from_payload(KINDS[head.kind], payload)


def _nested(messages, allowed, outer: str) -> list:
    """Inner messages as [kind, size, payload...] each."""
    payload = []
    for inner in messages:
        if type(inner) not in allowed:
            raise WireError(f"a {outer} cannot carry {type(inner).__name__}")
        values = _payload(inner)
        payload += [inner.KIND, len(values), *values]
    return payload


def _unnested(payload: list[int], allowed, outer: str) -> list:
    messages, at = [], 0
    while at < len(payload):
        if at + 2 > len(payload):
            raise WireError(f"{outer} message {len(messages)} runs past the payload's {len(payload)} ints")
        kind, size = payload[at : at + 2]
        inner = KINDS.get(kind)
        if inner not in allowed or size < 0 or at + 2 + size > len(payload):
            raise WireError(f"{outer} message {len(messages)}: kind {kind} with {size} ints does not fit")
        messages.append(_from_payload(inner, payload[at + 2 : at + 2 + size]))
        at += 2 + size
    return messages


def _payload(msg: Message) -> list:
    if isinstance(msg, StepPlan):
        return _step_plan_payload(msg)
    if isinstance(msg, (Prefill, Verify)):
        return spans_payload(msg.spans)
    if isinstance(msg, Round):
        return steps_payload(msg.steps)
    if isinstance(msg, Admit):
        return [msg.lane, msg.num_cached, msg.copy_from, *msg.blocks]
    return [getattr(msg, field.name) for field in fields(msg)]


def _from_payload(cls: type, payload: list[int]) -> Message:
    if cls is StepPlan:
        return _step_plan(_unnested(payload, (*LANE_CHANGES, *_PASSES), "StepPlan"))
    if cls in (Prefill, Verify):
        return cls(spans_from(payload))
    if cls is Round:
        return Round(steps_from(payload))
    if cls is Admit:
        if len(payload) < 3:
            raise WireError(
                f"an Admit payload starts with its lane, cached length and copy source, got {len(payload)} ints"
            )
        return Admit(payload[0], tuple(payload[3:]), payload[1], payload[2])
    num_fields = len(fields(cls))
    if len(payload) != num_fields:
        raise WireError(f"a {cls.__name__} payload holds {num_fields} ints, got {len(payload)}")
    return cls(*payload)


def _step_plan_payload(plan: StepPlan) -> list:
    """Its parts as [kind, size, payload...] each, in the order they are applied."""
    if not plan.parts:
        raise WireError("an empty StepPlan: a step carries lanes or a pass")
    if plan.prefill is not None and (not isinstance(plan.prefill, Prefill) or not plan.prefill.spans):
        raise WireError(f"a StepPlan's prompts are a Prefill of at least one span, got {plan.prefill!r}")
    payload = _nested(plan.lanes, LANE_CHANGES, "StepPlan's lanes")
    payload += _nested(() if plan.round is None else (plan.round,), (Round, Verify), "StepPlan's round")
    return payload + _nested(() if plan.prefill is None else (plan.prefill,), (Prefill,), "StepPlan")


def _step_plan(parts: list) -> StepPlan:
    """A StepPlan from its parts in wire order: lane changes, then a round, then prompts (each
    optional, not all absent); any other order or an empty Prefill is refused."""
    num_lanes = next((i for i, part in enumerate(parts) if not isinstance(part, LANE_CHANGES)), len(parts))
    rest = parts[num_lanes:]
    round_msg = rest.pop(0) if rest and isinstance(rest[0], (Round, Verify)) else None
    prefill = rest.pop(0) if rest and isinstance(rest[0], Prefill) else None
    if rest or not parts or (prefill is not None and not prefill.spans):
        kinds = [type(part).__name__ for part in parts]
        raise WireError(f"a StepPlan is lane changes, then a round, then prompts (not empty), got {kinds}")
    return StepPlan(tuple(parts[:num_lanes]), round_msg, prefill)


def _as_int64(value) -> int:
    value = operator.index(value)  # a float or a str raises TypeError rather than being truncated
    if not _INT64_MIN <= value <= _INT64_MAX:
        raise OverflowError(f"{value} does not fit in int64")
    return value


def _check_tensor(tensor: torch.Tensor) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise WireError(f"a wire message is an int64 tensor, got {type(tensor).__name__}")
    if tensor.dtype != torch.int64 or tensor.dim() != 1:
        raise WireError(
            f"a wire message is a 1-D int64 tensor, got {tensor.dtype} of shape {list(tensor.shape)}"
        )
