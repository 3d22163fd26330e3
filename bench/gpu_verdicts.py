"""The GPU check's rows that only a device can show, each with a verdict: "pass", "fail", or why it
was not judged here ("no CUDA", "FlashInfer not installed", ...). Off a GPU every such row says so,
so `--random-model` passes on the CPU and a CUDA run judges them all.

- paged_kernel: FlashInfer's paged kernel (tpserve/kernels/paged_attention.py) against SDPA through the same
  block tables, a prefill pass (prompt chunks) and a decode round, bfloat16;
- decode_graphs: the launches a decode round makes with CUDA graphs and without (runtime launch
  calls counted by torch.profiler), and the host syncs of a graphed greedy round;
- quantized_products: torch's int4 product and fp8 _scaled_mm against the bfloat16 product of the
  same weights, at 1 and 32 rows: time and the largest difference;
- roofline verdicts on the decode rows (tokens/s against weights + KV bytes over bandwidth).
Thresholds are named below: each is a bar a served GPU should clear, not a measured promise.
"""

from __future__ import annotations

import time
from contextlib import contextmanager

import torch
from torch.profiler import ProfilerActivity, profile

from bench.gpu_passes import sync_warnings
from tpserve.kernels.attention import SpanView
from tpserve.kernels.fp8_linear import FP8, FP8_MAX, Fp8Weight
from tpserve.kernels.int4pack_linear import GROUP, Int4PackWeight
from tpserve.kernels.paged_attention import (
    FlashInfer,
    PagedPlan,
    _sdpa_through_pages,
    flashinfer_module,
    paged_attention,
)

NO_CUDA = "no CUDA"
PAGED_MAX_DIFF = 2e-2  # bfloat16 attention outputs of O(1) values: FlashInfer vs SDPA
GRAPH_LAUNCH_SHARE = 0.1  # a graphed round launches at most this share of the eager round's calls
MAX_SYNCS_PER_ROUND = 1  # the ids' copy to the host
QUANT_MAX_REL_DIFF = {"int4": 0.15, "fp8": 0.08}  # of the bf16 product's largest |value|
ROOF_SHARE = 0.3  # decode tokens/s at least this share of the bandwidth roofline
LAUNCH_CALLS = (
    "cudaLaunchKernel",
    "cudaLaunchKernelExC",
    "cuLaunchKernel",
    "cuLaunchKernelEx",
    "cudaGraphLaunch",
)


def verdict(ok: bool) -> str:
    return "pass" if ok else "fail"


def not_judged(device: torch.device) -> str | None:
    return None if device.type == "cuda" else NO_CUDA


def paged_kernel(device: torch.device, seed: int = 0) -> dict:
    """FlashInfer against SDPA on the same pool and tables: a prefill (a fresh prompt and a later
    chunk) and a decode round of 8 streams; Llama-8B heads (32 q, 8 kv, 128)."""
    why = not_judged(device) or (None if flashinfer_module() else "FlashInfer not installed (serving SDPA)")
    if why:
        return {"verdict": why}
    return paged_rows(device, FlashInfer(flashinfer_module(), device), seed)


def paged_rows(device: torch.device, backend: FlashInfer | None, seed: int = 0) -> dict:
    """paged_kernel's rows on `backend` (None: the SDPA fallback against itself, what the CPU tests
    run to check the passes this row builds)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    num_q, num_kv, head_dim, block_size, num_blocks = 32, 8, 128, 32, 256
    pool_k, pool_v = (
        torch.randn(num_kv, num_blocks * block_size, head_dim, generator=gen, device=device).to(
            torch.bfloat16
        )
        for _ in range(2)
    )
    order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
    rows = {}
    passes = {
        "prefill": [(0, 300), (700, 64)],
        "decode": [(n, 1) for n in (5, 40, 100, 333, 900, 31, 64, 2000)],
    }
    for name, shapes in passes.items():
        spans, offset, taken = [], 0, 0
        for start, length in shapes:
            count = -(-(start + length) // block_size)
            spans.append(SpanView(offset, start, length, tuple(order[taken : taken + count])))
            offset, taken = offset + length, taken + count
        q = torch.randn(offset, num_q, head_dim, generator=gen, device=device).to(torch.bfloat16)
        plan = PagedPlan(spans, pool_k.shape[1], block_size, device, backend)
        scale = head_dim**-0.5
        ours = paged_attention(q, pool_k, pool_v, plan, scale).float()
        theirs = _sdpa_through_pages(q, pool_k, pool_v, plan, scale).reshape(offset, -1).float()
        diff = float((ours - theirs).abs().max())
        rows[name] = {"max_abs_diff": diff, "verdict": verdict(diff <= PAGED_MAX_DIFF)}
    rows["verdict"] = verdict(all(r["verdict"] == "pass" for r in rows.values()))
    return rows


@contextmanager
def eager_rounds(engine):
    """The engine's decode rounds run eagerly meanwhile (its graphs set aside)."""
    graphs, engine.graphs = engine.graphs, None
    try:
        yield
    finally:
        engine.graphs = graphs


def decode_graphs(engine, lanes) -> dict:
    """Launch calls per decode round with graphs and without; host syncs of a graphed greedy round.
    lanes: bench/gpu_passes.py Lanes on the engine (prefilled)."""
    why = not_judged(engine.model.device)
    if why is None and engine.graphs is None:
        why = "this model's rounds run eagerly (the start-up log says why)"
    if why:
        return {"verdict": why}
    counts = {"graphs_on": _launches(lanes)}
    with eager_rounds(engine):
        counts["graphs_off"] = _launches(lanes)
    syncs = sync_warnings(lanes.round)
    fewer = counts["graphs_on"] <= GRAPH_LAUNCH_SHARE * counts["graphs_off"]
    return {
        "launch_calls_per_round": counts,
        "host_syncs_per_round": syncs,
        "launches_verdict": verdict(fewer),
        "syncs_verdict": verdict(syncs <= MAX_SYNCS_PER_ROUND),
        "verdict": verdict(fewer and syncs <= MAX_SYNCS_PER_ROUND),
    }


def _launches(lanes) -> int:
    """Runtime launch calls (kernels, graphs) of one decode round, after one warm-up round (where a
    bucket's graph is captured)."""
    lanes.round()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        lanes.round()
    return sum(e.count for e in prof.key_averages() if e.key in LAUNCH_CALLS)


def _timed(product, x, repeats: int = 20) -> float:
    """Seconds per call, on the device's clock (the host's on the CPU)."""
    for _ in range(3):
        product(x)
    if x.device.type != "cuda":
        started = time.perf_counter()
        for _ in range(repeats):
            product(x)
        return (time.perf_counter() - started) / repeats
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        product(x)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / repeats


def int4_of(weight: torch.Tensor) -> Int4PackWeight:
    """weight [out, in] in 4-bit groups of 32 (d * q + m by each group's min and max)."""
    groups = weight.float().reshape(weight.shape[0], -1, GROUP)
    low, high = groups.amin(-1), groups.amax(-1)
    d = ((high - low) / 15).clamp_min(1e-8)
    q = ((groups - low.unsqueeze(-1)) / d.unsqueeze(-1)).round().clamp(0, 15).to(torch.uint8)
    return Int4PackWeight.from_blocks(q.reshape(weight.shape), d, low, torch.bfloat16)


def fp8_of(weight: torch.Tensor) -> Fp8Weight:
    """weight [out, in] in float8_e4m3fn with a scale per output channel."""
    scales = weight.float().abs().amax(-1).clamp_min(1e-8) / FP8_MAX
    return Fp8Weight((weight.float() / scales.unsqueeze(-1)).to(FP8), scales, torch.bfloat16)


def quantized_products(device: torch.device, shape: tuple[int, int] = (14336, 4096)) -> dict:
    """int4 and fp8 against bfloat16 for one [out, in] weight (Llama-8B's gate): time per call at 1
    and 32 rows, and the largest difference from the bf16 product, relative to its largest value."""
    why = not_judged(device)
    if why:
        return {"verdict": why}
    return quantized_rows(device, shape)


def quantized_rows(device: torch.device, shape: tuple[int, int]) -> dict:
    """quantized_products' rows on any device (the CPU runs torch's twins of both products)."""
    gen = torch.Generator(device=device).manual_seed(0)
    weight = (torch.randn(*shape, generator=gen, device=device) / shape[1] ** 0.5).to(torch.bfloat16)
    dense = lambda x: x @ weight.T  # noqa: E731
    rows, verdicts = {}, []
    for name, build in (("int4", int4_of), ("fp8", fp8_of)):
        try:
            packed = build(weight)
        except Exception as error:  # a GPU generation the product does not run on, in the report
            rows[name] = {"error": f"{type(error).__name__}: {error}"[:500], "verdict": "fail"}
            verdicts.append(False)
            continue
        row = {}
        for num_rows in (1, 32):
            x = torch.randn(num_rows, shape[1], generator=gen, device=device).to(torch.bfloat16)
            reference = dense(x).float()
            diff = float((packed(x).float() - reference).abs().max() / reference.abs().max())
            bf16_s, ours_s = _timed(dense, x), _timed(packed, x)
            row[f"rows_{num_rows}"] = {
                "bf16_us": bf16_s * 1e6,
                "us": ours_s * 1e6,
                "speedup": bf16_s / ours_s,
                "max_rel_diff": diff,
            }
        ok = (
            all(r["max_rel_diff"] <= QUANT_MAX_REL_DIFF[name] for r in row.values())
            and row["rows_1"]["speedup"] > 1
        )
        row["verdict"] = verdict(ok)
        rows[name] = row
        verdicts.append(ok)
    rows["verdict"] = verdict(all(verdicts))
    return rows


def roof_verdicts(decode: dict, device: torch.device) -> dict:
    """decode (gpu_check's decode_checks rows) with a verdict per row and for all."""
    why = not_judged(device)
    if "rows" not in decode:
        return decode
    for row in decode["rows"]:
        row["verdict"] = why or verdict(row["of_roof"] >= ROOF_SHARE)
    decode["verdict"] = why or verdict(all(r["verdict"] == "pass" for r in decode["rows"]))
    return decode


def timed_run(elapsed_s: float, device: torch.device, limit_s: float = 600.0) -> dict:
    """The whole run under ten minutes (judged on a GPU: the CPU's time depends on its cores)."""
    return {"elapsed_s": elapsed_s, "verdict": not_judged(device) or verdict(elapsed_s < limit_s)}


def verdicts(checks: dict) -> dict[str, str]:
    """Each check's verdict by name (a check that raised: fail; one with none: its own keys decide)."""
    out = {}
    for name, check in checks.items():
        if "error" in check:
            out[name] = "fail"
        elif "verdict" in check:
            out[name] = check["verdict"]
        elif "skipped" in check:
            out[name] = f"skipped: {check['skipped']}"
    return out
