"""The lane host: rank 0's scheduler, turning queued requests into streams of tokens on the backend's lanes.

One scheduling thread drives the backend (every Backend call happens there); clients submit, read
and cancel from any thread. The host's lock (host_state.py) guards only the queue, the set of
unfinished jobs and the flags threads share, and is never held across a backend call, so submit,
cancel and stats never wait on the engine.

LaneHost is the clients' face and the wiring. What a step does is lane_scheduler.py's (its plan,
step_plan.py, with admit_plan.py's admission, AdmitChoice in admit_choice.py deciding what to take;
Admission, lane_admit.py, runs the plan's prompt passes; the scheduler applies the plan and what
its pass reports); the thread's life (start, idle, stop, failure) is scheduler_thread.py's.
A BackendBroken anywhere latches the host broken: every stream ends with an error, new work is
refused and `on_broken` is called once so the daemon can exit non-zero.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

from tpserve.ranks.step_profile import NoProfile, StepProfile
from tpserve.server.backend import Backend, check_backend
from tpserve.server.drafts import Drafter
from tpserve.server.host_state import HostState
from tpserve.server.kv_blocks import BlockStats
from tpserve.server.lane_admit import Admission
from tpserve.server.lane_job import Job, reserve_for
from tpserve.server.lane_scheduler import Scheduler
from tpserve.server.lane_stream import Stream
from tpserve.server.lane_table import LaneTable
from tpserve.server.requests import ERROR, GenerationRequest, HostStats, TokenLogprob
from tpserve.server.sampled_tokens import SampledTokens
from tpserve.server.scheduler_thread import SchedulerThread

__all__ = ["LaneHost", "Stream", "HostStats"]

log = logging.getLogger(__name__)


class LaneHost:
    def __init__(
        self,
        backend: Backend,
        *,
        detokenize: Callable[[Sequence[int]], str] | None,
        eos_ids: frozenset[int],
        queue_size: int = 64,
        clock: Callable[[], float] = time.monotonic,
        batch_prefill: bool = True,
        on_broken: Callable[[str], None] | None = None,
        prefix_caching: bool = False,
        max_draft_tokens: int = 0,
        draft_rows: int = 16,
        logprobs: Callable[[int, int], TokenLogprob | None] | None = None,
        step_tokens: int | None = None,
        profile: StepProfile | NoProfile | None = None,
        prompt_logprobs: Callable[[int], dict[int, TokenLogprob]] | None = None,
        detokenize_special: Callable[[Sequence[int]], str] | None = None,
        on_step: Callable[[], None] | None = None,
    ):
        """logprobs(lane, position): the backend's log probability of the token its last pass
        sampled there (rank 0's Leader.logprobs), for requests whose sampling asks; None: none.
        detokenize None: streams carry bare tokens, no text and no stop strings (the front process
        makes the text, tpserve/server/front_link.py, with or without special tokens). on_step: called on
        the scheduling thread after each step (the front link sends what a step produced in one
        message).
        step_tokens: the rows one decode round and the prompt chunk riding in it carry (None: no
        cap; tpserve/ranks/settings.py says why one). profile: the step timers
        (tpserve/ranks/step_profile.py),
        when measured.
        prompt_logprobs(lane): the prompt log probabilities the lane's passes gathered, by position
        (rank 0's Leader.prompt_logprobs); None: requests asking for them get none.
        detokenize_special: the text of ids with special tokens kept, for requests that set
        skip_special_tokens false; None: such requests are refused (unless the front makes the text)."""
        check_backend(backend)
        if backend.num_lanes < 1 or backend.max_prefill_tokens < 1:
            raise ValueError(
                f"the backend needs at least one lane and one prompt token per pass "
                f"(num_lanes {backend.num_lanes}, max_prefill_tokens {backend.max_prefill_tokens})"
            )
        self._detokenize = detokenize
        self._detokenize_special = detokenize_special
        self._eos_ids = frozenset(eos_ids)
        self._clock = clock
        self._room = backend.room
        self._context_size = backend.context_size
        self._state = HostState(queue_size, clock)
        self._lanes = LaneTable(backend, prefix_caching=prefix_caching)
        admission = Admission(backend, self._lanes, batch_prefill=batch_prefill, step_tokens=step_tokens)
        # Draft tokens (tpserve/server/drafts.py) when asked for and the backend can check them.
        speculates = max_draft_tokens > 0 and backend.verifies_drafts
        if max_draft_tokens > 0 and not speculates:
            log.warning("draft tokens are off: %s does not verify drafts", type(backend).__name__)
        self.drafter = Drafter(max_draft_tokens, draft_rows) if speculates else None
        self._scheduler = Scheduler(
            backend,
            self._state,
            admission,
            self._lanes,
            SampledTokens(
                eos_ids=frozenset(eos_ids), clock=clock, logprobs=logprobs, prompt_logprobs=prompt_logprobs
            ),
            drafter=self.drafter,
            on_broken=on_broken,
            profile=profile or NoProfile(),
        )
        self._thread = SchedulerThread(backend, self._state, self._scheduler, on_step=on_step)

    @property
    def broken(self) -> bool:
        return self._state.broken_reason is not None

    @property
    def broken_reason(self) -> str | None:
        return self._state.broken_reason

    def submit(self, request: GenerationRequest) -> Stream:
        """Queue a request. Raises QueueFull, HostUnavailable, or ValueError for a request that cannot run."""
        reserve = reserve_for(request, self._context_size)
        # No detokenizer: bare tokens, the front keeps or drops special tokens in its text.
        detokenize = self._detokenize
        if detokenize is not None and not request.skip_special_tokens:
            detokenize = self._detokenize_special
            if detokenize is None:
                raise ValueError("this server cannot keep special tokens in a reply's text")
        job = Job(
            request,
            reserve=reserve,
            detokenize=detokenize,
            submitted_at=self._clock(),
            cancel=self._state.cancel,
            eos_ids=self._eos_ids,
        )
        never_fits = self._lanes.blocks.blocks_for(reserve) > self._lanes.blocks.num_blocks
        self._state.add(job, queued=not never_fits)
        if never_fits:
            self._state.finish(
                job, ERROR, f"the request needs {reserve} tokens of KV room; the engine holds {self._room}"
            )
        return job.stream

    def stats(self) -> HostStats:
        queued = self._state.num_queued()
        return HostStats(
            queued=queued,
            lanes_busy=self._lanes.num_busy,
            room_used=self._lanes.room_used,
            num_lanes=self._lanes.num_lanes,
            room=self._room,
            draft_tokens=self.drafter.num_drafted if self.drafter else 0,
            draft_tokens_accepted=self.drafter.num_accepted if self.drafter else 0,
            preempted=self._scheduler.num_preempted,
        )

    def block_stats(self) -> BlockStats:
        """The KV blocks and the prefix cache in them (read by metrics at scrape time)."""
        return self._lanes.blocks.stats()

    def step(self) -> bool:
        """One scheduling iteration (lane_scheduler.py). False when there was nothing it could do."""
        return self._scheduler.step()

    def start(self) -> None:
        """Run the scheduler on a daemon thread; it sleeps on a condition when idle."""
        self._thread.start()

    def fail(self, reason: str) -> None:
        """From any thread: the engine is gone (a rank lost); every stream ends now with an error."""
        self._thread.fail(reason)

    def stop(self, grace_s: float) -> bool:
        """Stop admitting; live streams get grace_s to finish, the rest end cancelled. False when
        the scheduler is stuck in a backend call (a follower that does not answer)."""
        return self._thread.stop(grace_s)
