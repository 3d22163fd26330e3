"""Every wire message survives encode -> decode, and a malformed tensor is refused, never misread."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tpserve.ranks.wire import (
    HEAD_SIZE,
    INLINE_SIZE,
    MAX_PAYLOAD_SIZE,
    WIRE_VERSION,
    WireError,
    decode,
    encode,
    read_head,
)
from tpserve.ranks.wire_messages import Admit, Idle, Prefill, Release, Round, StepPlan, Stop, Verify
from tpserve.ranks.wire_spans import Span, Step

int64s = st.integers(min_value=-(1 << 63), max_value=(1 << 63) - 1)
counts = st.integers(min_value=0, max_value=1 << 40)
token_ids = st.lists(st.integers(min_value=0, max_value=1 << 20), max_size=200).map(tuple)


@st.composite
def spans(draw):
    """A span, with media runs inside its tokens (image positions) and multimodal rotary positions
    (three per token) now and then."""
    tokens = draw(token_ids)
    runs, at = [], 0
    while at < len(tokens) and draw(st.booleans()):
        offset = draw(st.integers(min_value=at, max_value=len(tokens) - 1))
        length = draw(st.integers(min_value=1, max_value=len(tokens) - offset))
        runs.append((offset, length))
        at = offset + length
    rope = draw(st.lists(counts, min_size=3 * len(tokens) + 1, max_size=3 * len(tokens) + 1)) if runs else ()
    every_row = draw(st.booleans())
    return Span(draw(counts), draw(counts), tokens, tuple(runs), draw(block_lists), every_row, tuple(rope))


block_lists = st.lists(counts, max_size=6).map(tuple)
steps = st.builds(Step, lane=counts, position=counts, token_id=int64s, blocks=block_lists)

lane_changes = st.one_of(
    st.builds(Admit, lane=counts, blocks=block_lists, num_cached=counts, copy_from=counts),
    st.builds(Release, lane=counts),
)
rounds = st.one_of(
    st.none(),
    st.builds(Round, steps=st.lists(steps, max_size=64).map(tuple)),
    st.builds(Verify, spans=st.lists(spans(), max_size=8).map(tuple)),
)
prompts = st.one_of(
    st.none(), st.builds(Prefill, spans=st.lists(spans(), min_size=1, max_size=17).map(tuple))
)
plans = st.builds(
    StepPlan, lanes=st.lists(lane_changes, max_size=5).map(tuple), round=rounds, prefill=prompts
).filter(lambda plan: plan.parts)
messages = st.one_of(
    plans,
    lane_changes,
    st.builds(Prefill, spans=st.lists(spans(), max_size=16).map(tuple)),
    st.builds(Round, steps=st.lists(steps, max_size=64).map(tuple)),
    st.builds(Verify, spans=st.lists(spans(), max_size=16).map(tuple)),
    st.just(Idle()),
    st.just(Stop()),
)


@settings(max_examples=300, deadline=None)
@given(msg=messages, seq=counts)
def test_every_kind_round_trips(msg, seq):
    tensor = encode(msg, seq)
    assert tensor.dtype == torch.int64 and tensor.dim() == 1
    assert decode(tensor) == msg
    head = read_head(tensor[:HEAD_SIZE])
    assert (head.kind, head.seq) == (msg.KIND, seq)
    assert tensor.numel() == HEAD_SIZE + head.overflow_size


def test_a_long_packed_prefill_goes_in_the_overflow():
    msg = Prefill(tuple(Span(lane, 17 * lane, tuple(range(lane, lane + 500))) for lane in range(16)))
    tensor = encode(msg, seq=9)
    head = read_head(tensor[:HEAD_SIZE])
    # lane, start, tokens, media runs, blocks, every_row, rope ints
    assert head.payload_size == 1 + 16 * (7 + 500)
    assert head.overflow_size == head.payload_size - INLINE_SIZE
    assert decode(tensor) == msg


def test_a_payload_that_just_fits_inline_has_no_overflow():
    msg = Round(tuple(Step(lane, 100 + lane, 7) for lane in range(INLINE_SIZE // 4)))
    assert encode(msg).numel() == HEAD_SIZE
    longer = Round((*msg.steps, Step(99, 1, 2)))
    assert encode(longer).numel() == HEAD_SIZE + 4 * (len(longer.steps)) - INLINE_SIZE
    assert decode(encode(longer)) == longer


def test_lists_are_accepted_and_frozen_as_tuples():
    msg = Prefill([Span(0, 0, [1, 2, 3])])
    assert msg == Prefill((Span(0, 0, (1, 2, 3)),))
    assert decode(encode(msg)) == msg


@pytest.mark.parametrize(
    "msg, problem",
    [
        (Admit(0, (1.5,)), "integer"),
        (Release("3"), "integer"),
        (Release(1 << 63), "int64"),
        (Round((Step(0, 0, -(1 << 64)),)), "int64"),
    ],
)
def test_values_that_are_not_int64_are_refused(msg, problem):
    with pytest.raises(WireError, match=problem):
        encode(msg)


def test_a_step_plan_is_its_lanes_then_its_round_then_its_prompts():
    plan = StepPlan(
        (Release(2), Admit(2, (5, 6), 32)), Round((Step(0, 40, 7, (9,)),)), Prefill((Span(2, 32, (1, 2)),))
    )
    assert decode(encode(plan)) == plan and plan.parts[-1] == plan.prefill
    with pytest.raises(WireError, match="cannot carry Idle"):
        encode(StepPlan((Release(0), Idle())))
    with pytest.raises(WireError, match="empty StepPlan"):
        encode(StepPlan())
    with pytest.raises(WireError, match="at least one span"):
        encode(StepPlan(round=Round((Step(0, 1, 2),)), prefill=Prefill(())))
    with pytest.raises(WireError, match="cannot carry Prefill"):
        encode(StepPlan(round=Prefill((Span(0, 0, (1,)),))))
    tensor = encode(StepPlan((Release(3),))).clone()
    tensor[4] = Idle.KIND  # the inner message's kind
    with pytest.raises(WireError, match="kind 8"):
        decode(tensor)
    # A round after the prompts, or a second round, is no plan.
    prompt, round_msg = encode(Prefill((Span(0, 0, (1,)),))), encode(Round((Step(1, 2, 3),)))
    parts = [Prefill.KIND, int(prompt[3]), *prompt[4 : 4 + int(prompt[3])].tolist()]
    parts += [Round.KIND, int(round_msg[3]), *round_msg[4 : 4 + int(round_msg[3])].tolist()]
    tensor = encode(StepPlan((Release(0),))).clone()
    tensor[3] = len(parts)
    tensor[4 : 4 + len(parts)] = torch.tensor(parts)
    with pytest.raises(WireError, match="then a round, then prompts"):
        decode(tensor)


def test_a_step_that_only_decodes_over_30_lanes_fits_in_the_head():
    plan = StepPlan(round=Round(tuple(Step(lane, 100 + lane, 7) for lane in range(30))))
    assert encode(plan).numel() == HEAD_SIZE and decode(encode(plan)) == plan


def test_a_non_message_is_refused():
    with pytest.raises(WireError, match="not a wire message"):
        encode(Span(0, 0, (1,)))
    with pytest.raises(WireError, match="negative sequence"):
        encode(Idle(), seq=-1)


def _tampered(msg, index, value):
    tensor = encode(msg, seq=3).clone()
    tensor[index] = value
    return tensor


@pytest.mark.parametrize(
    "tensor, problem",
    [
        (_tampered(Idle(), 0, 12345), "bad magic"),
        (_tampered(Idle(), 0, encode(Idle())[0].item() + 1), f"wire version {WIRE_VERSION + 1}"),
        (_tampered(Idle(), 1, 77), "unknown message kind 77"),
        (_tampered(Idle(), 2, -4), "negative sequence"),
        (_tampered(Idle(), 3, MAX_PAYLOAD_SIZE + 1), "payload size"),
        (_tampered(Release(4), 3, 2), "Release payload holds 1 ints, got 2"),
        (_tampered(Round((Step(1, 2, 3),)), 3, 3), "step 0 runs past"),
        (_tampered(Round((Step(1, 2, 3, (4,)),)), 7, 2), "claims 2 blocks"),
        (_tampered(Prefill((Span(0, 0, (5, 6)),)), 7, 9), "claims 9 tokens"),
        (_tampered(Prefill((Span(0, 0, (5, 6)),)), 4, 2), "runs past"),
        (
            _tampered(Prefill((Span(0, 0, (5, 6)),)), 3, 8),
            "claims 2 tokens, 0 media runs and 0 blocks; the payload has 0",
        ),
        (
            _tampered(Prefill((Span(0, 0, (5, 6), ((0, 1),)),)), 15, 3),
            r"media run \(0, 3\) outside its 2 tokens",
        ),
        (_tampered(Prefill((Span(0, 0, (5, 6)),)), 10, 2), "every_row is 2, not 0 or 1"),
        (_tampered(Prefill((Span(0, 0, (5, 6)),)), 11, 5), "5 rope positions for 2 tokens"),
        (_tampered(Prefill(()), 3, 0), "starts with its number of spans"),
        (_tampered(Prefill(()), 4, -1), "-1 spans"),
        (encode(Idle())[: HEAD_SIZE - 1], f"holds {HEAD_SIZE} ints"),
        (encode(Round(tuple(Step(i, i, i) for i in range(40))))[:-1], "takes .* ints on the wire"),
        (
            torch.cat([encode(Idle()), torch.zeros(2, dtype=torch.int64)]),
            "takes 128 ints on the wire, got 130",
        ),
        (encode(Idle()).to(torch.int32), "1-D int64"),
        (encode(Idle()).reshape(16, 8), "1-D int64"),
    ],
)
def test_malformed_tensors_raise_a_clear_wire_error(tensor, problem):
    with pytest.raises(WireError, match=problem):
        decode(tensor)


def test_a_prefill_with_trailing_ints_is_refused():
    tensor = encode(Prefill((Span(0, 0, (5, 6)),)))
    tensor[3] += 1  # one more payload int (inline, so the length still matches)
    with pytest.raises(WireError, match="1 ints after its 1 spans"):
        decode(tensor)
