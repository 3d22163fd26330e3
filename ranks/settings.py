"""What one rank needs to start: a frozen value built once from the YAML config and flags."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineSettings:
    model_dir: str
    dtype: str = "float32"
    tp_size: int = 2
    num_lanes: int = 8
    context_size: int = 2048
    # Bytes of KV memory each rank may use, one figure per rank (tests give the ranks different
    # budgets); empty: a share of the memory the rank finds free at start-up.
    kv_budget_bytes: tuple[int, ...] = ()
    cache_budget_bytes: int = 0
    max_prefill_tokens: int = 512
    batch_prefill: bool = True
    # Every product in fixed-shape tiles (checked by a start-up probe), so a reply never depends on its batch.
    batch_invariant: bool = True
    # Forward collectives between CPU ranks: "auto" (shared memory when every rank is on this host,
    # else gloo), "shared_memory" (required) or "gloo".
    cpu_collectives: str = "auto"
    # Prompt-lookup draft tokens a decode round may check per stream (0: none); see server/drafts.py.
    draft_tokens: int = 0
    threads_per_rank: int = 0  # 0: half the cores, so tp=1 and tp=2 run the same kernels
    init_timeout_s: float = 60.0
    collective_timeout_s: float = 60.0
    leader_dead_after_s: float = 30.0
    # The network interface the ranks talk over (gloo, NCCL, the store, the liveness link); empty:
    # let gloo and NCCL choose. Checked at start-up (ranks/network.py).
    interface: str = ""
    # Fault drill for tests: (rank, token id) — that rank refuses any prompt holding the token.
    refuse_token_on_rank: tuple[int, int] | None = None
    # Fault drill for tests: that rank's start-up probe checks a deliberately shape-dependent product.
    shape_dependent_on_rank: int | None = None
