"""Admission's passes: the prompt passes a step's plan gives the jobs it admitted, up to each one's
first sampled token.

The plan (step_plan.py, its admission in admit_plan.py) takes the jobs, opens their lanes on the
shared blocks of their cached prefixes and books their blocks; what runs here is the prompt pass
of a plan in which nothing decodes (`run_prompts`: its joint prompts in one prefill_many, the rest
alone), a long prompt's next chunk while nothing decodes (`prefill_chunk`), each prompt alone after
a refusal (`run_alone`), and what a prompt pass that went through does to its job (`prefilled`).
A refusal or failure ends that job alone; only BackendBroken goes further (the host latches
broken).

Admission never touches the host's lock, queue or streams. Each call returns what happened
(admit_outcomes.py: a first token, an end, a wait for blocks) and the lane host applies that itself,
one way (STYLE 14, like vLLM v1's schedule() / update_from_output()). Every full block a pass
computes becomes shareable at once, so the chunks of one long prompt serve the next that starts so.
"""

from __future__ import annotations

import logging

from tpserve.server.admit_outcomes import BlockWait, Ended, FirstToken, Outcome
from tpserve.server.backend import Backend, BackendBroken, PrefillItem, attempt
from tpserve.server.lane_job import Job
from tpserve.server.lane_table import LaneTable
from tpserve.server.requests import CANCELLED, ERROR

log = logging.getLogger(__name__)

MAX_JOINT_PROMPTS = 16  # the most prompts one prefill_many pass takes (the Backend contract)
MIN_CHUNK_BESIDE = 16  # one row tile: a long prompt beside a full decode round still moves on


class Admission:
    def __init__(
        self,
        backend: Backend,
        lanes: LaneTable,
        *,
        batch_prefill: bool,
        step_tokens: int | None = None,
    ):
        """step_tokens: the rows a decode round and the chunk riding in it carry together (None: no
        cap, a whole max_prefill_tokens chunk)."""
        self._backend = backend
        self._lanes = lanes
        self.max_prefill_tokens = backend.max_prefill_tokens
        self._step_tokens = step_tokens
        batches = batch_prefill and backend.batches_prompts
        # Halved whenever the backend refuses a pass (returns None): it said it cannot take that many.
        self._joint_prompts_cap = MAX_JOINT_PROMPTS if batches else 1
        self.max_joint_prompts = self._joint_prompts_cap
        self.max_iterations = 2 * lanes.num_lanes + 16  # bounds one step's admission however many jobs fail

    def needs_chunks(self, job: Job) -> bool:
        """After setup: whether the prompt left past its cached prefix takes more than one pass."""
        return len(job.feed_ids) - job.cached_tokens > self.max_prefill_tokens

    def run_prompts(self, jobs: list[Job], joint: list[Job]) -> list[Outcome]:
        """A plan's whole prompts with nothing decoding (their blocks booked): the `joint` ones (the
        plan's, from joint_prompts) in one pass, all or none, the rest each alone; a refused joint
        pass goes again with each prompt alone, so only a refused one fails."""
        outcomes: list[Outcome] = []
        if joint:
            together = self._prefill_together(joint)
            if together is not None:
                outcomes += together
                jobs = [job for job in jobs if job not in joint]
        return outcomes + self.run_alone(jobs)

    def joint_prompts(self, ready: list[Job]) -> list[Job]:
        """The jobs of `ready` that go in one joint pass (the first that fit in one pass together),
        when two or more do; else none. Reads only."""
        whole, num_tokens = [], 0
        for job in ready:
            new_tokens = len(job.feed_ids) - job.cached_tokens
            if num_tokens + new_tokens <= self.max_prefill_tokens:
                whole.append(job)
                num_tokens += new_tokens
        return whole if len(whole) >= 2 else []

    def run_alone(self, jobs: list[Job]) -> list[Outcome]:
        """Each whole prompt in a pass of its own (after a pass with them was refused)."""
        return [
            Ended(job, CANCELLED) if job.cancel_requested else self._prefill(job, self._whole_prompt(job))
            for job in jobs
        ]

    def _prefill_together(self, jobs: list[Job]) -> list[Outcome] | None:
        """One prefill_many over `jobs`. None when the backend refused or failed (none prefilled), or
        when their blocks are not all free."""
        items = [self._whole_prompt(job) for job in jobs]
        if None in items:
            return None
        tokens, error = attempt(self._backend.prefill_many, items)
        if error is not None:
            log.warning(
                "a joint prompt pass over %d streams failed (%r); prefilling each alone", len(jobs), error
            )
            return None
        if tokens is None:
            # It may not take that many at once: fewer next time, then more again after a success.
            self.max_joint_prompts = max(2, len(jobs) // 2)
            log.info(
                "the engine refused a joint prompt pass over %d streams; prefilling each alone", len(jobs)
            )
            return None
        if len(tokens) != len(jobs):
            raise BackendBroken(f"prefill_many returned {len(tokens)} tokens for {len(jobs)} prompts")
        if len(jobs) >= self.max_joint_prompts:
            self.max_joint_prompts = min(self._joint_prompts_cap, 2 * self.max_joint_prompts)
        outcomes: list[Outcome] = []
        for job, token in zip(jobs, tokens):
            self._lanes.sent(job)
            job.num_prefilled = len(job.feed_ids)
            self._lanes.keep_computed(job, job.num_prefilled)
            outcomes.append(FirstToken(job, token))
        return outcomes

    def prefill_chunk(self, job: Job) -> list[Outcome]:
        """The next chunk of `job`'s long prompt. No outcome while more chunks are to come, or while
        the chunk's blocks are not free (it waits for them: BlockWait)."""
        if job.cancel_requested:
            return [Ended(job, CANCELLED)]
        item = self._next_chunk(job)
        if item is None:
            return [BlockWait(job)]
        outcome = self._prefill(job, item)
        return [] if outcome is None else [outcome]

    def _next_chunk(self, job: Job) -> PrefillItem | None:
        """The next max_prefill_tokens tokens (never ending inside an image that goes whole: Job.chunk_end);
        None when their blocks are not free."""
        start = job.num_prefilled
        num_tokens = job.chunk_end(start, self.max_prefill_tokens) - start
        if not self._lanes.cover(job, start + num_tokens):
            return None
        return self.prompt_item(job, start, num_tokens)

    def _whole_prompt(self, job: Job) -> PrefillItem | None:
        """None when the prompt's blocks are not free."""
        if not self._lanes.cover(job, len(job.feed_ids)):
            return None
        return self.prompt_item(job, job.cached_tokens, len(job.feed_ids) - job.cached_tokens)

    def prompt_item(self, job: Job, start: int, num_tokens: int) -> PrefillItem:
        """The pass over feed_ids[start:start+num_tokens], with the blocks booked for the lane that
        its backend table does not hold yet (the caller booked what the pass writes)."""
        last = start + num_tokens == len(job.feed_ids)
        return PrefillItem(
            job.lane,
            start,
            job.feed_ids[start : start + num_tokens],
            last,
            job.request.sampling,
            job.request.images,
            self._lanes.new_blocks(job),
            job.allowed_tokens() if last else None,
            job.counts,
            *_prompt_rows(job, start, num_tokens),
            prompt_length=len(job.request.prompt_ids),
        )

    def _prefill(self, job: Job, item: PrefillItem | None) -> Outcome | None:
        """One pass; None after a chunk that is not the prompt's last. BlockWait when `item` is None
        (its blocks are not free)."""
        if item is None:
            return BlockWait(job)
        token, error = attempt(self._backend.prefill, item)
        if error is not None:
            return Ended(job, ERROR, f"prefill failed: {error}")
        return self.prefilled(job, item.start + len(item.token_ids), item.last, token)

    def chunk_size(self, num_rows: int) -> int:
        """The most tokens of the chunking prompt in a pass beside a decode round of `num_rows` rows
        (0: nothing decodes, a whole pass): what the step's token budget leaves after the round (a
        pass costs about its rows, so the decoders' next token comes about as soon as without it),
        at least one row tile."""
        if self._step_tokens is None or num_rows == 0:
            return self.max_prefill_tokens
        return min(self.max_prefill_tokens, max(MIN_CHUNK_BESIDE, self._step_tokens - num_rows))

    def prefilled(self, job: Job, end: int, last: bool, token: int | None) -> Outcome | None:
        """A pass over the job's prompt up to `end` went through (`last`: it ended the prompt, and
        `token` is what it sampled after it). None after a chunk that is not the prompt's last."""
        self._lanes.sent(job)
        job.num_prefilled = end
        self._lanes.keep_computed(job, job.num_prefilled)
        if not last:
            return None
        if token is None:
            return Ended(job, ERROR, "the engine sampled no token after the prompt")
        return FirstToken(job, token)


def _prompt_rows(job: Job, start: int, num_tokens: int) -> tuple[int, tuple[int, ...]]:
    """PrefillItem's prompt_logprobs and prompt_targets for a pass over feed_ids[start:start+num_tokens]:
    the prompt tokens each row scores, when the job gathers its prompt's log probabilities."""
    if not job.gathers_prompt_logprobs:
        return -1, ()
    prompt = job.request.prompt_ids
    return job.request.prompt_logprobs, tuple(prompt[start + 1 : min(start + num_tokens + 1, len(prompt))])
