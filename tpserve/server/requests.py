"""What a client asks the lane host for and what it gets back: requests, stream events, usage, refusals.

Plain frozen values shared by the lane host, the gRPC servicer and the tests; nothing here runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tpserve.kernels.sampling_params import SamplingParams, TokenLogprob

if TYPE_CHECKING:
    from tpserve.server.grammar import Grammar

__all__ = [
    "CANCELLED",
    "ERROR",
    "LENGTH",
    "STOP",
    "Event",
    "Finished",
    "GenerationRequest",
    "HostStats",
    "HostUnavailable",
    "Prefilled",
    "PromptImage",
    "QueueFull",
    "SamplingParams",
    "TokenDelta",
    "TokenLogprob",
    "Usage",
]

# Finish reasons, as the API reports them.
STOP = "stop"  # an EOS token or a stop string
LENGTH = "length"  # max_tokens reached
CANCELLED = "cancelled"  # the client cancelled, or the host stopped before the reply ended
ERROR = "error"  # this stream failed (Finished.error says why)


@dataclass(frozen=True)
class PromptImage:
    """An image's (or a video's) place in a prompt: positions offset..offset+num_tokens-1 hold its features.

    `features` is opaque here (a [num_tokens, hidden] tensor the vision tower made; the lane host
    only hands it to the backend). `key` stands for the image's tokens in the prompt cache: it is
    derived from the image's content hash and negative, so it never equals a token id.
    """

    offset: int
    num_tokens: int
    key: int
    features: object = field(compare=False, repr=False)
    # A Qwen-VL image's merged grid (rows, columns): its tokens' multimodal rotary positions
    # (tpserve/ranks/mrope.py); None for a model whose rotary is 1-D.
    grid: tuple[int, int] | None = None
    # A video's temporal patches, and the time positions between them (tokens_per_second * the
    # seconds one spans): its tokens are frames * rows * columns; an image is one frame.
    frames: int = 1
    interval: float = 1.0
    # Its positions go in one pass (no chunk ends inside them): Gemma 3's image tokens see each
    # other (tpserve/kernels/attention.py SpanView.images), so all of them must be in the pass
    whole: bool = False


@dataclass(frozen=True)
class GenerationRequest:
    """One reply to generate from already tokenized prompt ids.

    `background` requests wait behind every foreground one and give their lane up to a waiting
    foreground request (resuming later without resending anything).
    """

    prompt_ids: tuple[int, ...]
    max_tokens: int
    sampling: SamplingParams
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    background: bool = False
    # Prompt offsets worth keeping in the prompt cache besides the prompt's end (the start of the
    # last user turn, the end of a system block), from the chat template.
    keep_boundaries: tuple[int, ...] = ()
    images: tuple[PromptImage, ...] = ()  # in prompt order; only from a server started with --vision
    # Structured outputs: every sampled token is masked to what this grammar allows next.
    grammar: Grammar | None = None
    stop_token_ids: tuple[int, ...] = ()  # the reply ends at any of these (ignore_eos or not)
    # EOS and stop_token_ids are barred (-inf) until the reply has this many tokens (as vLLM);
    # stop strings still end it earlier.
    min_tokens: int = 0
    include_stop_str_in_output: bool = False  # a matched stop string's text ends the reply's text
    # >= 0: the log probability of each prompt token after the first and that many likeliest
    # alternatives, sent with Prefilled (the prompt is then computed whole, never from the cache).
    prompt_logprobs: int = -1
    skip_special_tokens: bool = True  # false: special tokens (role markers, EOS) stay in the text

    def cache_ids(self) -> tuple[int, ...]:
        """The prompt as the prompt cache keys it: each image's positions hold its key, not the
        image token, so the same image matches and a different one never does."""
        if not self.images:
            return self.prompt_ids
        ids = list(self.prompt_ids)
        for image in self.images:
            ids[image.offset : image.offset + image.num_tokens] = [image.key] * image.num_tokens
        return tuple(ids)


@dataclass(frozen=True)
class Usage:
    """What one reply cost.

    completion_tokens counts every token the model sampled for the reply, the EOS token and the
    tokens of a matched stop string included (their text is never sent).
    """

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    time_to_first_token_s: float | None  # submit to the first sampled token; None if none came
    total_s: float  # submit to Finished


@dataclass(frozen=True)
class Prefilled:
    """The prompt is in the KV cache (sent once per stream, before its first token)."""

    cached_tokens: int
    # When the request set prompt_logprobs: one per prompt token after the first, in order, and
    # the prompt's token ids (the first has no log probability).
    prompt_logprobs: tuple[TokenLogprob, ...] = ()
    prompt_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class TokenDelta:
    """Newly released reply tokens and their text (text held back for stop strings comes later)."""

    token_ids: tuple[int, ...]
    text: str
    logprobs: tuple[TokenLogprob, ...] = ()  # one per token id, when the request's sampling asked


@dataclass(frozen=True)
class Finished:
    """The last event of every stream."""

    reason: str  # STOP, LENGTH, CANCELLED or ERROR
    usage: Usage
    error: str | None = None


Event = Prefilled | TokenDelta | Finished


@dataclass(frozen=True)
class HostStats:
    """A snapshot of the lane host's load (read by metrics at scrape time)."""

    queued: int  # requests waiting for a lane
    lanes_busy: int  # lanes holding a stream (prefilling or decoding)
    room_used: int  # KV tokens the open lanes' blocks hold
    num_lanes: int
    room: int  # KV tokens the ranks can hold in all
    draft_tokens: int = 0  # draft tokens decode rounds checked, since start
    draft_tokens_accepted: int = 0  # of those, the ones the model agreed with (kept in replies)
    preempted: int = 0  # streams that gave up their lane for want of KV blocks, since start


class QueueFull(Exception):
    """Refused at submit: the queue already holds as many requests as it may."""


class HostUnavailable(Exception):
    """Refused at submit: the engine is broken or the host is stopping."""
