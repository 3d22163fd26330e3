"""A pass's spans and steps, and their ints on the wire (tpserve/ranks/wire.py frames the messages).

A span goes as its head (lane, start, number of tokens, of media runs, of blocks, every_row, number
of rope ints), then its tokens, media runs, blocks and rope positions; a step as lane, position,
token id, number of blocks, then its blocks. Decoding checks every count against what is left, so a
tensor that is not a well-formed message raises WireError naming the field.
"""

from __future__ import annotations

from dataclasses import dataclass


class WireError(ValueError):
    """A message that cannot be encoded, or a tensor that is not a well-formed message."""


@dataclass(frozen=True)
class Span:
    """Prompt tokens for positions start..start+len(token_ids)-1 of `lane`.

    `media`: (offset, length) runs of the span's tokens whose embeddings are image features (rank 0
    holds the features; every rank zeroes those rows, see tpserve/kernels/embedding.py). `blocks`: KV blocks
    appended to the lane's block table before the pass. `every_row`: the pass returns the logits of
    every token of the span, not only its last (a prompt's log probabilities, rank 0's only; every
    rank takes part in those rows' logits gather, so every rank must know). `rope`: for a model with
    multimodal rotary positions (tpserve/ranks/mrope.py), the tokens' t, then h, then w positions, then the
    lane's delta after the span (3 * len(token_ids) + 1 ints), or empty: each token at its KV
    position plus the lane's delta.
    """

    lane: int
    start: int
    token_ids: tuple[int, ...]
    media: tuple[tuple[int, int], ...] = ()
    blocks: tuple[int, ...] = ()
    every_row: bool = False
    rope: tuple[int, ...] = ()

    def __post_init__(self):
        object.__setattr__(self, "token_ids", tuple(self.token_ids))
        object.__setattr__(self, "media", tuple((int(o), int(n)) for o, n in self.media))
        object.__setattr__(self, "blocks", tuple(self.blocks))
        object.__setattr__(self, "rope", tuple(self.rope))

    def media_rows(self) -> list[int]:
        """The span's own row offsets that carry image features, in order."""
        return [offset + k for offset, length in self.media for k in range(length)]


@dataclass(frozen=True)
class Step:
    """Feed `token_id` at `position` of `lane`, `blocks` appended to its block table first."""

    lane: int
    position: int
    token_id: int
    blocks: tuple[int, ...] = ()

    def __post_init__(self):
        object.__setattr__(self, "blocks", tuple(self.blocks))


_STEP_HEAD_SIZE = 4  # lane, position, token id, number of blocks
# lane, start, number of tokens, number of media runs, number of blocks, every_row, rope ints
_SPAN_HEAD_SIZE = 7


def spans_payload(spans: tuple[Span, ...]) -> list[int]:
    payload = [len(spans)]
    for span in spans:
        if len(span.rope) not in (0, 3 * len(span.token_ids) + 1):
            raise WireError(f"a span of {len(span.token_ids)} tokens with {len(span.rope)} rope positions")
        payload += [span.lane, span.start, len(span.token_ids), len(span.media), len(span.blocks)]
        payload += [int(span.every_row), len(span.rope)]
        payload += [*span.token_ids, *(value for run in span.media for value in run)]
        payload += [*span.blocks, *span.rope]
    return payload


def steps_payload(steps: tuple[Step, ...]) -> list[int]:
    payload = []
    for step in steps:
        payload += [step.lane, step.position, step.token_id, len(step.blocks), *step.blocks]
    return payload


def steps_from(payload: list[int]) -> tuple[Step, ...]:
    steps, at = [], 0
    while at < len(payload):
        if at + _STEP_HEAD_SIZE > len(payload):
            raise WireError(f"Round step {len(steps)} runs past the payload's {len(payload)} ints")
        lane, position, token_id, num_blocks = payload[at : at + _STEP_HEAD_SIZE]
        at += _STEP_HEAD_SIZE
        if num_blocks < 0 or at + num_blocks > len(payload):
            raise WireError(
                f"Round step {len(steps)} claims {num_blocks} blocks; the payload has {len(payload) - at} ints left"
            )
        steps.append(Step(lane, position, token_id, tuple(payload[at : at + num_blocks])))
        at += num_blocks
    return tuple(steps)


def spans_from(payload: list[int]) -> tuple[Span, ...]:
    if not payload:
        raise WireError("a Prefill payload starts with its number of spans, got nothing")
    num_spans, at = payload[0], 1
    if num_spans < 0:
        raise WireError(f"a Prefill with {num_spans} spans")
    spans = []
    for index in range(num_spans):
        if at + _SPAN_HEAD_SIZE > len(payload):
            raise WireError(
                f"Prefill span {index} of {num_spans} runs past the payload's {len(payload)} ints"
            )
        head = payload[at : at + _SPAN_HEAD_SIZE]
        lane, start, num_tokens, num_media, num_blocks, every_row, num_rope = head
        at += _SPAN_HEAD_SIZE
        size = num_tokens + 2 * num_media + num_blocks + num_rope
        if every_row not in (0, 1):
            raise WireError(f"Prefill span {index}: every_row is {every_row}, not 0 or 1")
        if num_rope not in (0, 3 * num_tokens + 1):
            raise WireError(f"Prefill span {index}: {num_rope} rope positions for {num_tokens} tokens")
        if min(num_tokens, num_media, num_blocks) < 0 or at + size > len(payload):
            raise WireError(
                f"Prefill span {index} claims {num_tokens} tokens, {num_media} media runs and "
                f"{num_blocks} blocks; the payload has {len(payload) - at} ints left"
            )
        tokens = tuple(payload[at : at + num_tokens])
        at += num_tokens
        media = tuple((payload[at + 2 * i], payload[at + 2 * i + 1]) for i in range(num_media))
        at += 2 * num_media
        blocks = tuple(payload[at : at + num_blocks])
        at += num_blocks
        rope = tuple(payload[at : at + num_rope])
        at += num_rope
        for offset, length in media:
            if offset < 0 or length <= 0 or offset + length > num_tokens:
                raise WireError(
                    f"Prefill span {index}: media run ({offset}, {length}) outside its {num_tokens} tokens"
                )
        spans.append(Span(lane, start, tokens, media, blocks, bool(every_row), rope))
    if at != len(payload):
        raise WireError(f"a Prefill payload has {len(payload) - at} ints after its {num_spans} spans")
    return tuple(spans)
