"""One request inside the lane host: where it stands, what it produced, and the events it sends.

The scheduling thread owns a job once it leaves the queue; the only field another thread writes is
`cancel_requested` (a note the scheduler reads at its next boundary).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence

from tpserve.kernels.token_counts import TokenCounts
from tpserve.server.lane_stream import Stream
from tpserve.server.reply_text import RawReply, ReplyText, ends_reply
from tpserve.server.requests import GenerationRequest, TokenLogprob, Usage


def reserve_for(request: GenerationRequest, context_size: int) -> int:
    """The KV tokens a request's lane must hold; ValueError for a request that can never run."""
    num_prompt = len(request.prompt_ids)
    if num_prompt == 0:
        raise ValueError("the prompt is empty")
    if request.max_tokens < 1:
        raise ValueError(f"max_tokens must be at least 1, got {request.max_tokens}")
    if num_prompt + request.max_tokens > context_size:
        raise ValueError(
            f"the prompt ({num_prompt} tokens) plus max_tokens ({request.max_tokens}) exceeds "
            f"the context size ({context_size} tokens)"
        )
    return min(num_prompt + request.max_tokens, context_size)


class Job:
    def __init__(
        self,
        request: GenerationRequest,
        *,
        reserve: int,
        detokenize: Callable[[Sequence[int]], str] | None,
        submitted_at: float,
        cancel: Callable[[Job], None],
        eos_ids: frozenset[int] = frozenset(),
    ):
        self.request = request
        self._cache_prompt = request.cache_ids()
        self.reserve = reserve  # the most KV tokens its lane can reach: prompt + max_tokens, capped
        self.stream = Stream(lambda: cancel(self))
        # detokenize None: the front process makes the text (tpserve/server/front_process.py); the stream
        # sends bare tokens and stop strings are the front's to match.
        self.reply = (
            RawReply(request, self.stream.put)
            if detokenize is None
            else ReplyText(request, detokenize, self.stream.put)
        )
        # The tokens rank 0's logit adjustments read (penalties, logit_bias, min_tokens), kept here
        # with the stream so they follow it across lanes.
        self.counts: TokenCounts | None = None
        if request.sampling.adjusts_logits or request.min_tokens > 0:
            barred = request.stop_token_ids + (() if request.ignore_eos else tuple(eos_ids))
            self.counts = TokenCounts(request.prompt_ids, min_tokens=request.min_tokens, barred=barred)
        self.produced: list[int] = []  # every sampled token, sent or held back
        self.lane: int | None = None
        self.blocks: list[int] = []  # its lane's block table in the host's book (lane_table.py)
        self.num_blocks_sent = 0  # how many of them the backend's table holds (the rest go with a pass)
        self.num_blocks_kept = 0  # how many of them the book made findable for prefix sharing
        self.block_keys: list[bytes] = []  # the keys of cache_ids' first full blocks (kv_blocks.py)
        self.admitted_seq = 0  # when it last got a lane (the newest background stream yields first)
        self.cached_tokens = 0  # prompt tokens shared blocks supplied (prefix caching)
        self.num_prefilled = 0  # tokens of feed_ids already in the lane (chunked prefill progress)
        self.prefilled_sent = False
        self.cancel_requested = False
        self.submitted_at = submitted_at
        self.seq = 0  # its number in submission order (HostState gives it): how a plan names it
        self.first_token_at: float | None = None
        # Structured outputs: the stream's place in its grammar, advanced on every kept token.
        self.matcher = request.grammar.matcher() if request.grammar is not None else None

    def scratch(self) -> Job:
        """A copy whose lane, blocks and progress a plan may change while it tries admission
        (tpserve/server/admit_plan.py); the request, stream and tokens are this job's, only read there."""
        clone = copy.copy(self)
        clone.blocks = list(self.blocks)
        clone.block_keys = list(self.block_keys)
        return clone

    @property
    def background(self) -> bool:
        return self.request.background

    @property
    def feed_ids(self) -> tuple[int, ...]:
        """What a (re-)prefill puts in the lane: the prompt, then every token produced so far.

        A stream resuming after a yield prefills its own tokens too, so its next sample lands at the
        position it would have reached without the yield.
        """
        return self.request.prompt_ids + tuple(self.produced)

    def chunk_end(self, start: int, max_tokens: int) -> int:
        """Where a pass over feed_ids from `start` of at most max_tokens ends: never inside an image
        that goes in one pass (PromptImage.whole, Gemma 3's): before it where the pass reaches it,
        else (the pass starts inside or at it, after a cached prefix or the chunk before) after its
        last token, past max_tokens if it must be (a step's token budget beside a decode round; the
        daemon refuses a max_prefill_tokens under an image's tokens, so never past that)."""
        end = min(len(self.feed_ids), start + max_tokens)
        for image in self.request.images:
            first, last = image.offset, image.offset + image.num_tokens
            if image.whole and first < end < last:
                end = first if first > start else last
        return end

    @property
    def cache_ids(self) -> tuple[int, ...]:
        """feed_ids as the prompt cache keys them (image positions by their image's key)."""
        return self._cache_prompt + tuple(self.produced)

    @property
    def next_position(self) -> int:
        """Where the last sampled token goes when a decode round feeds it."""
        return len(self.request.prompt_ids) + len(self.produced) - 1

    @property
    def wants_logprobs(self) -> bool:
        return self.request.sampling.logprobs >= 0

    @property
    def gathers_prompt_logprobs(self) -> bool:
        """The request asks for its prompt's log probabilities and has not had them yet: its prompt
        passes return every row, and none of its prompt comes from the cache."""
        return self.request.prompt_logprobs >= 0 and not self.prefilled_sent

    @property
    def next_token_position(self) -> int:
        """Where the next sampled token goes (its log probability is keyed by it)."""
        return len(self.request.prompt_ids) + len(self.produced)

    def allowed_tokens(self):
        """The grammar mask of the next draw (tpserve/kernels/sampling.py's `allowed`), or None when free."""
        return None if self.matcher is None else self.matcher.allowed()

    def accept(
        self, token_id: int, eos_ids: frozenset[int], now: float, logprob: TokenLogprob | None = None
    ) -> str | None:
        """Take one sampled token, send what text it releases; the finish reason when the reply ends."""
        self.produced.append(token_id)
        if self.counts is not None:
            self.counts.add(token_id)
        if self.first_token_at is None:
            self.first_token_at = now
        ends = ends_reply(self.request, token_id, eos_ids)
        if not ends and self.matcher is not None and token_id not in eos_ids:
            # An EOS kept under ignore_eos leaves the grammar where it was (complete).
            self.matcher.accept(token_id)
        return self.reply.take(token_id, logprob if self.wants_logprobs else None, ends)

    def usage(self, now: float) -> Usage:
        first = None if self.first_token_at is None else self.first_token_at - self.submitted_at
        return Usage(
            prompt_tokens=len(self.request.prompt_ids),
            completion_tokens=len(self.produced),
            cached_tokens=self.cached_tokens,
            time_to_first_token_s=first,
            total_s=now - self.submitted_at,
        )
