"""Admission: getting the jobs taken off the queue into lanes, up to each one's first sampled token.

Three steps per job, as in the design: take it off the queue when its first pass's KV blocks are
free (admit_choice.py says which), set it up (a lane, with the shared blocks of its prompt's cached
prefix: kv_blocks.py), launch it (its own prefill, chunks of a long prompt between decode rounds, or
one prefill_many with other jobs). A refusal or failure ends that job alone and frees what it held;
only BackendBroken goes further (the host latches broken).

Admission runs the passes; it never touches the host's lock, queue or streams. Each call returns
what happened (admit_outcomes.py: a first token, an end, a prompt that goes in chunks) and the lane
host applies that itself, one way (STYLE 14, like vLLM v1's schedule() / update_from_output()).
Which job is chunking is the host's to record; it is passed in. Every full block a pass computes
becomes shareable at once, so the chunks of one long prompt serve the next that starts so.
"""

from __future__ import annotations

import logging

from tpserve.server.admit_outcomes import BlockWait, Chunking, Ended, FirstToken, Outcome, Riding
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
        self._max_prefill_tokens = backend.max_prefill_tokens
        self._step_tokens = step_tokens
        batches = batch_prefill and backend.batches_prompts
        # Halved whenever the backend refuses a pass (returns None): it said it cannot take that many.
        self._joint_prompts_cap = MAX_JOINT_PROMPTS if batches else 1
        self.max_joint_prompts = self._joint_prompts_cap
        self.max_iterations = 2 * lanes.num_lanes + 16  # bounds one step's admission however many jobs fail
        # Prompt passes tried so far: the scheduler reads whether a launch ran one (then that pass
        # is its step's one message, and the streams it started decode from the next step on).
        self.num_passes = 0

    def _needs_chunks(self, job: Job) -> bool:
        """After setup: whether the prompt left past the restored prefix takes more than one pass."""
        return len(job.feed_ids) - job.cached_tokens > self._max_prefill_tokens

    def launch(self, jobs: list[Job], chunking: Job | None, beside_round: bool = False) -> list[Outcome]:
        """Set up the taken jobs and launch them. `beside_round` (streams are decoding): each whole
        prompt rides in this step's decode round (Riding); else short prompts go in one joint pass
        when two or more, the rest alone. `chunking`: the job whose prompt goes in chunks now, if any."""
        outcomes: list[Outcome] = []
        ready = []
        for job in jobs:
            refusal = self._setup(job)
            if refusal is None:
                ready.append(job)
            else:
                outcomes.append(refusal)
        if beside_round:
            riding = [job for job in ready if not job.cancel_requested and not self._needs_chunks(job)]
            for job in riding:
                item = self._whole_prompt(job)
                outcomes.append(BlockWait(job) if item is None else Riding(job, item))
            ready = [job for job in ready if job not in riding]
        return outcomes + self.run_now(ready, chunking)

    def run_now(self, ready: list[Job], chunking: Job | None) -> list[Outcome]:
        """Launch jobs that are set up in passes of their own: short prompts in one joint pass when
        two or more, the rest alone, a long one in chunks (or every chunk now while another chunks)."""
        outcomes: list[Outcome] = []
        # A job taken as short can turn out long when its restore failed: it launches alone. Jobs
        # whose restores failed can also be short each and too long together: the joint pass takes
        # them while they fit in one pass, the rest go alone.
        whole = self.joint_prompts(ready)
        if whole:
            joint = self._prefill_together(whole)
            if joint is not None:
                outcomes += joint
                ready = [job for job in ready if job not in whole]
        for job in ready:
            if job.cancel_requested:
                outcomes.append(Ended(job, CANCELLED))
            elif not self._needs_chunks(job):
                outcomes.append(self._prefill(job, self._whole_prompt(job)))
            elif chunking is None:
                chunking = job  # its chunks run one per step, between decode rounds
                outcomes.append(Chunking(job))
            else:
                outcomes.append(self._prefill_all_chunks(job))
        return outcomes

    def joint_prompts(self, ready: list[Job]) -> list[Job]:
        """The jobs of `ready` that go in one joint pass (the first that fit in one pass together),
        when two or more do; else none. Reads only."""
        whole, num_tokens = [], 0
        for job in ready:
            new_tokens = len(job.feed_ids) - job.cached_tokens
            if num_tokens + new_tokens <= self._max_prefill_tokens:
                whole.append(job)
                num_tokens += new_tokens
        return whole if len(whole) >= 2 else []

    def run_alone(self, jobs: list[Job]) -> list[Outcome]:
        """Each whole prompt in a pass of its own (after a pass with them was refused)."""
        return [
            Ended(job, CANCELLED) if job.cancel_requested else self._prefill(job, self._whole_prompt(job))
            for job in jobs
        ]

    def _setup(self, job: Job) -> Ended | None:
        """Lane, shared prefix and first blocks. None when the job is ready, else how it ended."""
        if job.cancel_requested:
            return Ended(job, CANCELLED)
        # The shared prefix's blocks now; the rest of the first pass's come with its prefill.
        self._lanes.open(job, 0)
        return None

    def _prefill_together(self, jobs: list[Job]) -> list[Outcome] | None:
        """One prefill_many over `jobs`. None when the backend refused or failed (none prefilled), or
        when their blocks are not all free."""
        items = [self._whole_prompt(job) for job in jobs]
        if None in items:
            return None
        self.num_passes += 1
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

    def _prefill_all_chunks(self, job: Job) -> Outcome:
        """Every chunk now: a job taken as short whose restore failed while another job chunks.

        Safe: no pass exceeds max_prefill_tokens, only one job is ever chunking, and the job has its
        first token before a decode round sees its lane. The price (this step's decode round waits)
        is paid only after a failed restore.
        """
        while True:
            outcome = self._prefill(job, self._next_chunk(job))
            if outcome is not None:  # the last chunk's first token, a failed chunk's end, a wait
                return outcome

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

    def _next_chunk(self, job: Job, size: int | None = None) -> PrefillItem | None:
        """The next `size` tokens (max_prefill_tokens unless said); None when their blocks are not free."""
        start = job.num_prefilled
        num_tokens = job.chunk_end(start, size or self._max_prefill_tokens) - start
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
        self.num_passes += 1
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
            return self._max_prefill_tokens
        return min(self._max_prefill_tokens, max(MIN_CHUNK_BESIDE, self._step_tokens - num_rows))

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
