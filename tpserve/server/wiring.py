"""Rank 0's wiring: the leader as the lane host's backend (with the recorder when asked), and the
prompt cache over the leader's cache pool.

The daemon builds it behind gRPC; tests and benchmarks build it with `local_engine` (no gRPC).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from tpserve.kernels.linear import ROW_TILE
from tpserve.ranks.leader import Leader
from tpserve.ranks.local_ranks import local_rank0
from tpserve.ranks.settings import EngineSettings
from tpserve.ranks.startup import RankRuntime
from tpserve.ranks.step_profile import profile_from_environment
from tpserve.server.lane_host import LaneHost
from tpserve.server.recorder import RecordingBackend
from tpserve.server.tokenizer import Tokenizer


def build_lane_host(
    runtime: RankRuntime,
    tokenizer: Tokenizer,
    *,
    queue_size: int = 64,
    record_dir: str = "",
    on_broken: Callable[[str], None] | None = None,
    makes_text: bool = True,
    on_step: Callable[[], None] | None = None,
) -> tuple[LaneHost, Leader]:
    """makes_text False: streams carry bare tokens, the front process makes the text (and
    on_step, the front link's, sends each step's tokens in one message)."""
    settings = runtime.settings  # as the rank started: "auto" decided for its device
    profile = profile_from_environment()  # off unless bench/step_profile.py asks for the timers
    leader = Leader(
        runtime.engine,
        runtime.channel,
        num_lanes=settings.num_lanes,
        context_size=settings.context_size,
        max_prefill_tokens=settings.max_prefill_tokens,
        batches_prompts=settings.batch_prefill,
        record_features=bool(record_dir),
        profile=profile,
    )
    backend = RecordingBackend(leader, record_dir) if record_dir else leader
    host = LaneHost(
        backend,
        detokenize=tokenizer.decode if makes_text else None,
        eos_ids=eos_ids_of(runtime, tokenizer),
        queue_size=queue_size,
        batch_prefill=settings.batch_prefill,
        on_broken=on_broken,
        prefix_caching=settings.prefix_caching,
        # Drafts ride in the rows batch-invariant products are padded to anyway; without that
        # padding they would cost rows of their own.
        max_draft_tokens=settings.draft_tokens if settings.batch_invariant else 0,
        draft_rows=ROW_TILE,
        logprobs=leader.logprobs,  # the leader's own, past the recorder: only rank 0 has logits
        step_tokens=settings.step_tokens,
        profile=profile,
        prompt_logprobs=leader.prompt_logprobs,
        detokenize_special=lambda ids: tokenizer.decode(ids, skip_special_tokens=False),
        on_step=on_step,
    )
    return host, leader


def eos_ids_of(runtime: RankRuntime, tokenizer: Tokenizer) -> frozenset[int]:
    """The tokens that end a reply: the tokenizer's and the model config's."""
    return tokenizer.eos_ids | frozenset(runtime.config.eos_token_ids)


@dataclass
class LocalEngine:
    host: LaneHost
    leader: Leader
    runtime: RankRuntime
    tokenizer: Tokenizer
    followers: list  # the follower processes (multiprocessing.Process)


@contextmanager
def local_engine(
    settings: EngineSettings,
    *,
    queue_size: int = 64,
    record_dir: str = "",
    on_step: Callable[[], None] | None = None,
) -> Iterator[LocalEngine]:
    """Rank 0 in this process with a started lane host, followers as child processes; all stopped
    on exit (Stop to the followers unless the engine broke). One per process at a time. on_step:
    called on the scheduling thread after each step (a benchmark marks where steps end)."""
    with local_rank0(settings) as (runtime, followers):
        tokenizer = Tokenizer.from_model_dir(settings.model_dir)
        host, leader = build_lane_host(
            runtime, tokenizer, queue_size=queue_size, record_dir=record_dir, on_step=on_step
        )
        host.start()
        try:
            yield LocalEngine(host, leader, runtime, tokenizer, followers)
        finally:
            host.stop(grace_s=0)
            leader.stop()  # Stop to the followers, unless the engine broke
