"""Which lane holds which job, and which KV blocks each holds: the scheduler thread's book.

Opening, growing and closing lanes go through here so the book and the backend never disagree. A
lane opens with the cached blocks of its prompt's longest shared prefix (kv_blocks.py) and blocks for
its first pass; later blocks are booked when they are allocated (`cover`) and reach the backend with
the next pass over the lane (`new_blocks`, then `sent` once the pass went through); a pass that
fails or is refused sends them again with the next. Once a block's KV is computed it is made
findable for later prompts (`keep_computed`). A close that fails leaves the engine in an unknown
state, so it is reported as BackendBroken.
"""

from __future__ import annotations

import copy

from tpserve.server.backend import Backend, BackendBroken, attempt
from tpserve.server.kv_blocks import KVBlocks, extend_keys
from tpserve.server.lane_job import Job


class LaneTable:
    def __init__(self, backend: Backend, *, prefix_caching: bool = False):
        self._backend = backend
        self.num_lanes = backend.num_lanes
        self.blocks = KVBlocks(backend.num_blocks, backend.block_size, prefix_caching=prefix_caching)
        self._free = list(range(self.num_lanes))
        self._jobs: dict[int, Job] = {}
        self._num_admitted = 0

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_busy(self) -> int:
        return len(self._jobs)

    @property
    def room_used(self) -> int:
        """KV tokens the open lanes' blocks hold (read by stats from any thread)."""
        return self.blocks.num_used * self.blocks.block_size

    def job_on(self, lane: int) -> Job:
        """The job holding `lane`."""
        return self._jobs[lane]

    def jobs(self) -> list[Job]:
        """Every job holding a lane, in lane order."""
        return [self._jobs[lane] for lane in sorted(self._jobs)]

    def _keys(self, job: Job, num_blocks: int) -> list[bytes]:
        """The keys of the job's first `num_blocks` full blocks (of its cache_ids)."""
        extend_keys(job.block_keys, job.cache_ids, num_blocks, self.blocks.block_size)
        return job.block_keys[:num_blocks]

    def _shareable(self, job: Job) -> list[bytes]:
        # A prompt shares whole blocks, and always computes at least its last token (whose logits
        # sample the next one). A prompt whose log probabilities are asked for computes every token.
        if job.gathers_prompt_logprobs:
            return []
        return self._keys(job, (len(job.feed_ids) - 1) // self.blocks.block_size)

    def cached_prefix(self, job: Job) -> tuple[int, int]:
        """Before open: the prompt tokens shared blocks (and a partly matching block's copied slots)
        would supply now, and how many of those blocks are unreferenced (taking them costs as many
        free blocks). Changes nothing."""
        num_found, num_idle = self.blocks.find(self._shareable(job))
        return num_found * self.blocks.block_size + self._partial_match(job, num_found)[1], num_idle

    def _partial_match(self, job: Job, num_shared: int) -> tuple[int, int]:
        """A live lane's block that follows the same `num_shared` shared blocks and whose first
        computed slots hold the next tokens of `job`'s prompt: (that block, how many slots match),
        the longest match; (-1, 0) when none. Copying those slots gives the very bits a prefill would
        write (same prefix, same tokens at the same positions: vLLM's and SGLang's copy-on-write of
        a partly matching block). At least the prompt's last token is still computed, and a copy is
        never a whole block: a whole block's match (a computed block the cache holds under another
        block's key, or under none since that one went) copies all but its last slot, so the cached
        count stays inside the block and no rank reads the copy as a shared block."""
        size = self.blocks.block_size
        start, end = num_shared * size, len(job.feed_ids) - 1
        if not self.blocks.prefix_caching or job.gathers_prompt_logprobs or end - start <= 0:
            return -1, 0
        keys = self._keys(job, num_shared)
        wanted = job.cache_ids[start : min(end, start + size - 1)]
        best = (-1, 0)
        for other in self._jobs.values():
            computed = min(other.num_prefilled, start + size)
            if other is job or computed <= start + best[1] or len(other.blocks) <= num_shared:
                continue
            if num_shared and self._keys(other, num_shared)[-1] != keys[-1]:
                continue
            num_equal = 0
            for mine, theirs in zip(wanted, other.cache_ids[start:computed]):
                if mine != theirs:
                    break
                num_equal += 1
            if num_equal > best[1]:
                best = (other.blocks[num_shared], num_equal)
        return best

    def shares_uncomputed(self, job: Job, computing: list[Job]) -> bool:
        """Whether a job of `computing` (whose prompts go in a pass now or in later chunks) will
        compute the next full block of `job`'s prompt that is not cached yet: `job` then waits to
        share it rather than compute a copy (SGLang's in-batch prefix check; vLLM's prefix caching
        shares only what is computed). Keys chain their parents, so one equal key means the whole
        prefix up to it is equal. Changes nothing."""
        keys = self._shareable(job)
        num_found, _ = self.blocks.find(keys)
        if not self.blocks.prefix_caching or num_found == len(keys):
            return False
        size = self.blocks.block_size
        return any(
            len(other.feed_ids) >= (num_found + 1) * size
            and self._keys(other, num_found + 1)[num_found] == keys[num_found]
            for other in computing
            if other is not job
        )

    def open(self, job: Job, num_tokens: int) -> None:
        """Give `job` the lowest free lane with the shared blocks of its prompt's cached prefix and
        blocks for the rest of its first `num_tokens` positions (which the caller made sure are free:
        AdmitChoice.first_pass_blocks). Sets the job's cached_tokens."""
        if not self._free:
            raise RuntimeError("no free lane to open")
        lane = min(self._free)
        shared = self.blocks.share(self._shareable(job))
        # The source is a live lane's block: held, so this allocation cannot take it.
        copy_from, num_copied = self._partial_match(job, len(shared))
        self.blocks.note_copied(num_copied, bool(shared))
        num_cached = len(shared) * self.blocks.block_size + num_copied
        blocks = shared + self.blocks.allocate(
            self.blocks.blocks_for(max(num_tokens, num_cached)) - len(shared)
        )
        _, error = attempt(self._backend.open, lane, blocks, num_cached, copy_from)
        if error is not None:
            self.blocks.free(blocks)
            raise BackendBroken(f"opening lane {lane} failed: {error!r}") from error
        self._free.remove(lane)
        self._jobs[lane] = job
        job.lane = lane
        job.blocks, job.num_blocks_sent, job.num_blocks_kept = list(blocks), len(blocks), len(shared)
        job.cached_tokens = job.num_prefilled = num_cached
        self._num_admitted += 1
        job.admitted_seq = self._num_admitted

    def scratch(self, backend: Backend) -> tuple[LaneTable, dict[Job, Job]]:
        """A copy of the book on `backend` (one that runs nothing), each lane's job a scratch copy
        (Job.scratch), for a plan to try admission on (tpserve/server/admit_plan.py): nothing here
        changes. Returns it and the copies by the jobs they copy."""
        clone = copy.copy(self)
        clone._backend = backend
        clone.blocks = self.blocks.scratch()
        clone._free = list(self._free)
        copies = {job: job.scratch() for job in self._jobs.values()}
        clone._jobs = {lane: copies[job] for lane, job in self._jobs.items()}
        return clone, copies

    def keep_computed(self, job: Job, num_computed: int) -> None:
        """The job's KV is computed for positions below `num_computed`: its full blocks there become
        findable by later prompts that start the same way."""
        num_full = min(num_computed // self.blocks.block_size, len(job.blocks))
        if num_full > job.num_blocks_kept:
            keys = self._keys(job, num_full)
            start = job.num_blocks_kept
            self.blocks.register(job.blocks[start:num_full], keys[start:num_full])
            job.num_blocks_kept = num_full

    def blocks_missing(self, job: Job, end: int) -> int:
        """Blocks `job` still needs for its positions below `end`."""
        return max(0, self.blocks.blocks_for(end) - len(job.blocks))

    def cover(self, job: Job, end: int) -> bool:
        """Book blocks so the job's table covers its positions below `end`; False (nothing booked)
        when too few are free."""
        missing = self.blocks_missing(job, end)
        if not self.blocks.can_allocate(missing):
            return False
        job.blocks += self.blocks.allocate(missing)
        return True

    def book(self, planned: tuple[int, ...]) -> None:
        """Take from the pool the blocks a step's plan chose (tpserve/server/step_plan.py): they must be the
        ones the book hands out next, or the plan was made from another state (a bug: it raises)."""
        got = self.blocks.allocate(len(planned)) if planned else ()
        if got != planned:
            raise RuntimeError(f"the step's plan booked KV blocks {planned}; the book handed out {got}")

    @staticmethod
    def append(job: Job, blocks: tuple[int, ...]) -> None:
        """Add blocks `book` took for the plan to the job's table in the book."""
        job.blocks += blocks

    def covered(self, job: Job) -> int:
        """Positions the job's booked blocks hold."""
        return len(job.blocks) * self.blocks.block_size

    @staticmethod
    def new_blocks(job: Job) -> tuple[int, ...]:
        """The job's booked blocks the backend's table does not hold yet (they go with its next pass)."""
        return tuple(job.blocks[job.num_blocks_sent :])

    @staticmethod
    def sent(job: Job) -> None:
        """A pass over the job's lane went through: the backend's table holds every booked block."""
        job.num_blocks_sent = len(job.blocks)

    def close(self, job: Job) -> None:
        lane = job.lane
        if lane is None or self._jobs.get(lane) is not job:
            raise RuntimeError(f"closing a lane the job does not hold (lane {lane})")
        del self._jobs[lane]
        self._free.append(lane)
        job.lane = None
        self.blocks.free(job.blocks)
        job.blocks, job.num_blocks_sent, job.num_blocks_kept = [], 0, 0
        _, error = attempt(self._backend.close, lane)
        if error is not None:
            raise BackendBroken(f"closing lane {lane} failed: {error!r}") from error

    def forget_all(self) -> None:
        """Drop the book without calling a broken backend (the process is about to exit)."""
        for job in self._jobs.values():
            job.lane = None
            job.blocks, job.num_blocks_sent, job.num_blocks_kept = [], 0, 0
        self._jobs.clear()
        self._free = list(range(self.num_lanes))
        self.blocks.reset()
