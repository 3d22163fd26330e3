"""The seam between the lane host (plain Python, no torch) and whatever runs the model.

The real backend is rank 0's leader (`tpserve.ranks.leader`), which broadcasts each call to the
followers and applies it on its own shard; tests use a fake. Every method is called from the lane
host's single scheduling thread.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

from tpserve.kernels.sampling_params import SamplingParams
from tpserve.kernels.token_counts import TokenCounts
from tpserve.ranks.errors import BackendBroken, ChunkRefused
from tpserve.server.requests import PromptImage

__all__ = [
    "Backend",
    "BackendBroken",
    "ChunkRefused",
    "PrefillItem",
    "DecodeItem",
    "SamplingParams",
    "attempt",
    "check_backend",
]


T = TypeVar("T")


def attempt(operation: Callable[..., T], *args) -> tuple[T | None, Exception | None]:
    """Call a backend operation: (its result, None), or (None, the exception) when it raised.

    A BackendBroken is never caught: nothing more can run, whatever the caller would do about a
    failure (end one job, fall back, or count the engine broken)."""
    try:
        return operation(*args), None
    except BackendBroken:
        raise
    except Exception as error:
        return None, error


@dataclass(frozen=True)
class PrefillItem:
    """Compute the KV of `token_ids` at positions start..start+len-1 of `lane`.

    The lane's block table, with `blocks` appended, covers every position the chunk writes; a pass
    that fails or is refused appends nothing. When `last` is set this chunk ends the prompt and the backend samples the stream's next token
    at position start+len (keyed by `sampling`). `images`: the whole prompt's images; the backend
    embeds the features of those that fall in this chunk at their positions.
    """

    lane: int
    start: int
    token_ids: tuple[int, ...]
    last: bool
    sampling: SamplingParams
    images: tuple[PromptImage, ...] = ()
    blocks: tuple[int, ...] = ()  # KV blocks appended to the lane's block table before this pass
    # With `last`: the grammar mask of the token sampled (tpserve/kernels/sampling.py's `allowed`), or None.
    allowed: object = None
    counts: TokenCounts | None = None  # the stream's tokens, when its sampling adjusts logits
    # Prompt log probabilities (rank 0's Leader.prompt_logprobs), when prompt_logprobs >= 0 (that
    # many likeliest alternatives): row k of the chunk scores prompt_targets[k], the prompt token at
    # position start+k+1 (the chunk's next tokens, up to the prompt's end).
    prompt_logprobs: int = -1
    prompt_targets: tuple[int, ...] = ()
    # The prompt's own length where the pass goes past it (a resumed reply's tokens, at the positions
    # after the prompt's largest: tpserve/ranks/mrope.py chunk_rope); 0: the pass ends inside the prompt.
    prompt_length: int = 0


@dataclass(frozen=True)
class DecodeItem:
    """Feed `token_id` at `position` of `lane` and sample the token after it.

    With `draft` (decode_drafts only), the draft tokens follow at the next positions, and a token is
    sampled after each fed token.
    """

    lane: int
    position: int
    token_id: int
    sampling: SamplingParams
    draft: tuple[int, ...] = ()
    blocks: tuple[int, ...] = ()  # KV blocks appended to the lane's block table before this round
    # The grammar mask of the token sampled after token_id (tpserve/kernels/sampling.py's `allowed`), or
    # None; a constrained stream brings no draft.
    allowed: object = None
    counts: TokenCounts | None = None  # the stream's tokens, when its sampling adjusts logits


class Backend(Protocol):
    """Every operation the lane host may call. A backend, and every wrapper of one, has them all: what
    one cannot do it declares with a flag (`batches_prompts`, `verifies_drafts`), never by lacking a
    method, so wrapping a backend can never switch a capability off unseen. `check_backend` refuses
    one that lacks any, once, where it is taken."""

    num_lanes: int
    num_blocks: int  # KV blocks the ranks hold (the smallest rank's figure)
    block_size: int  # tokens per KV block
    room: int  # KV tokens the ranks can hold in all: num_blocks * block_size
    context_size: int  # most tokens (prompt + reply) one stream may reach
    batches_prompts: bool  # prefill_many is worth calling
    verifies_drafts: bool  # decode_drafts checks draft tokens (draft tokens are worth making)
    max_prefill_tokens: int  # most prompt tokens one pass takes (a longer prompt goes in chunks)

    def open(self, lane: int, blocks: tuple[int, ...], num_cached: int, copy_from: int = -1) -> None:
        """Open `lane` with `blocks` as its block table (more come with its passes). Its first
        `num_cached` positions are cached: whole blocks of a shared prefix (they already hold their
        KV, other lanes may hold them too, and no pass writes into them), then, when `num_cached` ends
        inside a block, that block (the lane's own) gets its first `num_cached % block_size` slots
        copied from block `copy_from`, a live lane's block holding the same tokens after the same prefix. The lane host books
        the blocks (tpserve/server/kv_blocks.py): it never hands out for writing a block another lane
        holds."""

    def prefill(self, item: PrefillItem) -> int | None:
        """One prompt chunk on one lane; the sampled token when item.last, else None.

        Raises on failure; the lane then holds no prefilled state and stays open (the host closes it).
        """

    def prefill_many(self, items: list[PrefillItem]) -> list[int] | None:
        """Several whole prompts (each item.last, start 0 or a cached start) in one pass.

        Returns one sampled token per item, in order. Returning None or raising leaves none of the
        lanes prefilled (the failing one included); the host then runs each alone.
        """

    def decode(self, items: list[DecodeItem], prompts: Sequence[PrefillItem] = ()) -> list[int]:
        """One round over the given live lanes; one sampled token per item, in order.

        `prompts` (of lanes not in the round: whole prompts, or a long prompt's next chunk) go in
        the same forward pass, so the decoding streams keep their pace and a step is one pass; each
        prompt that ends (item.last) adds the token sampled after it, in order, after the items'.
        Raises ChunkRefused when some rank refused a prompt (then nothing of the pass ran: the host
        runs the round again without them and each prompt alone), BackendBroken when the pass
        failed: the engine cannot go on.
        """

    def decode_drafts(self, items: list[DecodeItem], prompts: Sequence[PrefillItem] = ()) -> list[list[int]]:
        """A decode round whose items carry draft tokens (called only when verifies_drafts).

        Per item, 1 + len(draft) sampled tokens, the i-th sampled after feeding the token and its
        first i drafts. The host keeps the samples up to the first that differs from the next draft;
        the lane's later positions are rewritten by the next round (which starts where the kept
        tokens end). `prompts` as for decode (each ending prompt's token after the items', a list
        of one). Raises ChunkRefused and BackendBroken as decode does.
        """

    def close(self, lane: int) -> None:
        """Drop the lane and its block table (the host frees the blocks in its book)."""

    def idle(self) -> None:
        """Called once when the host runs out of work, before it waits. Rank 0's leader tells the
        followers to wait off any collective timeout (see tpserve/ranks/channel.py); a backend with no
        followers does nothing."""

    # Per-step features for `--record`: empty where the backend keeps none.
    def top_logits(self, lane: int) -> list[tuple[int, float]]:
        """(token id, logit) pairs with the highest logits at the lane's last sampled step, best first.

        Called right after the prefill or decode round that sampled the lane's latest token.
        """

    def draft_top_logits(self, lane: int) -> list[list[tuple[int, float]]]:
        """top_logits for each sampled row of the lane's last decode_drafts round, in order."""


# Every name a Backend has: its figures, flags and operations.
BACKEND_NAMES = (
    *Backend.__annotations__,
    *(name for name, value in vars(Backend).items() if callable(value) and not name.startswith("_")),
)


def check_backend(backend: object) -> None:
    """Refuse, at start-up, a backend (or wrapper) that lacks part of the protocol, naming each part."""
    missing = [name for name in BACKEND_NAMES if not hasattr(backend, name)]
    if missing:
        raise TypeError(
            f"{type(backend).__name__} is not a whole Backend (tpserve/server/backend.py): "
            f"it lacks {', '.join(missing)}"
        )
