"""What one rank needs to start: a frozen value built once from the YAML config and flags.

Its defaults are the daemon's: the serving config (tpserve/server/config.py ServeConfig) takes every engine
default from here, so an engine test that leaves a setting alone runs what `tpserve serve` runs.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from tpserve.kernels.weight_formats import QUANTIZE_CHOICES, auto_quantize

DTYPE_NAMES = ("float32", "bfloat16", "float16")  # the weights' and KV's types a rank can run
DTYPE_CHOICES = ("auto", *DTYPE_NAMES)  # auto: the device's (for_device)
MAX_DRAFT_TOKENS = 15  # a batch-invariant decode product holds 16 rows: the token and 15 drafts
STEP_TOKENS_CPU = 32  # bench.long_prompt_gap --step-tokens (bench/README.md): why 32
__all__ = ["DTYPE_CHOICES", "DTYPE_NAMES", "MAX_DRAFT_TOKENS", "QUANTIZE_CHOICES", "EngineSettings"]


@dataclass(frozen=True)
class EngineSettings:
    model_dir: str
    # "auto" (a GPU where torch can use one; never a silent CPU fallback where a GPU is present),
    # "cpu" or "cuda"; see tpserve/ranks/device.py.
    device: str = "auto"
    dtype: str = "auto"  # float32 on the CPU, bfloat16 on a GPU; or float32, bfloat16, float16
    # The KV pool's type: "auto" (float16 where the C attention kernel reads it, half float32's bytes;
    # else the weights' dtype) or one of DTYPE_NAMES; see tpserve/kernels/attention_kernels.py kv_dtype.
    kv_dtype: str = "auto"
    # "none", "int8" or "int4" (the linear layers' and head's weights quantized at load) or "auto":
    # see tpserve/kernels/weight_formats.py.
    quantize: str = "none"
    tp_size: int = 2
    num_lanes: int = 8
    context_size: int = 2048
    # Bytes of KV memory each rank may use, one figure per rank (tests give the ranks different
    # budgets); empty: a share of the memory the rank finds free at start-up.
    kv_budget_bytes: tuple[int, ...] = ()
    # Full KV blocks shared by every prompt that starts the same way (tpserve/server/kv_blocks.py).
    prefix_caching: bool = True
    # Tokens per KV block: the unit of room, admission and preemption (tpserve/server/kv_blocks.py).
    kv_block_size: int = 32  # bench/README.md, bench.attention --blocks: why 32
    max_prefill_tokens: int = 512
    # Rows one forward pass carries while streams decode: their decode and draft rows first, a long
    # prompt's chunk the rest (at least one row tile), so the decoders keep their pace while it fills
    # (tpserve/server/lane_scheduler.py). None: the device's (STEP_TOKENS_CPU on the CPU, where a pass costs
    # its rows; on a GPU, whatever a decode round and a whole max_prefill_tokens chunk make).
    step_tokens: int | None = None
    batch_prefill: bool = True
    # Every product in fixed-shape tiles (checked by a start-up probe), so a reply never depends on its batch.
    # None: the device's default (on the CPU, where it is proven, yes; on a GPU, no).
    batch_invariant: bool | None = None
    # Forward collectives between CPU ranks: "auto" (shared memory when every rank is on this host,
    # else gloo), "shared_memory" (required) or "gloo".
    cpu_collectives: str = "auto"
    # Prompt-lookup draft tokens a decode round may check per stream (0: none; None: 15 where
    # products are batch invariant, else 0); see tpserve/server/drafts.py.
    draft_tokens: int | None = None
    threads_per_rank: int = 0  # 0: half the cores, so tp=1 and tp=2 run the same kernels
    init_timeout_s: float = 120.0
    collective_timeout_s: float = 60.0
    leader_dead_after_s: float = 30.0
    # The network interface the ranks talk over (gloo, NCCL, the store, the liveness link); empty:
    # let gloo and NCCL choose. Checked at start-up (tpserve/ranks/network.py).
    interface: str = ""
    # Fault drill for tests: (rank, token id) — that rank refuses any prompt holding the token; ().
    refuse_token_on_rank: tuple[int, ...] = ()
    # Fault drill for tests: that rank's start-up probe checks a deliberately shape-dependent product.
    shape_dependent_on_rank: int | None = None

    def for_device(self, device_type: str) -> EngineSettings:
        """These settings with every "auto" decided for the device the rank runs on.

        Batch invariance (and the draft tokens that ride in its tiles' spare rows) is on by default
        on the CPU only, where its fixed-shape products are known to hold. A GPU picks its own
        kernels for a shape, and nothing has shown them to keep the promise there, so a GPU does not
        claim it by default; `batch_invariant: true` still asks for it, and then the start-up probe
        decides (every rank refuses when it fails).
        """
        gpu = device_type == "cuda"
        batch_invariant = not gpu if self.batch_invariant is None else self.batch_invariant
        draft_tokens = self.draft_tokens
        if draft_tokens is None:
            draft_tokens = MAX_DRAFT_TOKENS if batch_invariant else 0
        dtype = ("bfloat16" if gpu else "float32") if self.dtype == "auto" else self.dtype
        quantize = auto_quantize(device_type) if self.quantize == "auto" else self.quantize
        step_tokens = self.step_tokens
        if step_tokens is None:
            step_tokens = (
                self.max_prefill_tokens + self.num_lanes * (1 + draft_tokens) if gpu else STEP_TOKENS_CPU
            )
        return replace(
            self,
            batch_invariant=batch_invariant,
            draft_tokens=draft_tokens,
            dtype=dtype,
            quantize=quantize,
            step_tokens=step_tokens,
        )
