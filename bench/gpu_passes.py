"""Passes the GPU check times and inspects, on one rank started for real at tp=1 (`start_rank`,
so device choice, flags and room run as in the daemon) and driven through its Engine directly."""

from __future__ import annotations

import time
import warnings
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from torch.profiler import ProfilerActivity, profile

from tpserve.kernels.sampling import sample
from tpserve.kernels.sampling_params import SamplingParams
from tpserve.ranks.device_wait import to_host
from tpserve.ranks.engine import Engine, open_lane
from tpserve.ranks.local_ranks import free_port
from tpserve.ranks.settings import EngineSettings
from tpserve.ranks.startup import RankRuntime, shutdown, start_rank

GREEDY = SamplingParams()
WAIT_S = 120.0  # a pass or a copy that takes longer has hung
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")


@contextmanager
def one_rank(
    model_dir: str,
    device: str,
    dtype: str,
    *,
    num_lanes: int,
    context_size: int,
    threads: int,
    batch_invariant: bool = False,  # the served GPU mode; True runs the start-up probe
) -> Iterator[RankRuntime]:
    settings = EngineSettings(
        model_dir=model_dir,
        device=device,
        dtype=dtype,
        tp_size=1,
        num_lanes=num_lanes,
        context_size=context_size,
        batch_invariant=batch_invariant,
        draft_tokens=0,
        threads_per_rank=threads,
        collective_timeout_s=WAIT_S,
    )
    try:
        yield start_rank(settings, 0, 1, "127.0.0.1", free_port())
    finally:
        shutdown()  # also after a refused start, which may come once the group has formed


def prompt_logits(engine: Engine, prompt: Sequence[int]) -> torch.Tensor:
    """Next-token logits after every prompt token: [len(prompt), vocab] float32 on the CPU."""
    open_lane(engine, 0, len(prompt))
    try:
        return engine.forward([(0, 0, tuple(prompt))], every_row=True)
    finally:
        engine.release(0)


def greedy_tokens(engine: Engine, prompt: Sequence[int], num_tokens: int) -> list[int]:
    open_lane(engine, 0, len(prompt) + num_tokens)
    try:
        tokens = sample(engine.forward([(0, 0, tuple(prompt))]), [GREEDY], [len(prompt)])
        while len(tokens) < num_tokens:
            position = len(prompt) + len(tokens) - 1
            logits = engine.forward([(0, position, (tokens[-1],))])
            tokens += sample(logits, [GREEDY], [position + 1])
        return tokens
    finally:
        engine.release(0)


class Lanes:
    """`prompts` prefilled in lanes 0..n-1, then decoded a round at a time (greedy)."""

    def __init__(self, engine: Engine, prompts: Sequence[Sequence[int]], num_tokens: int):
        self.engine = engine
        self.lengths = [len(p) for p in prompts]
        self.tokens = []
        for lane, prompt in enumerate(prompts):
            open_lane(engine, lane, len(prompt) + num_tokens + 1)
            logits = engine.forward([(lane, 0, tuple(prompt))])
            self.tokens += sample(logits, [GREEDY], [len(prompt)])

    def round(self) -> None:
        """One decode round as the daemon serves it: Engine.decode_round (a graph's replay where the
        engine has them), its greedy ids taken on the device on a GPU (the leader's choice there)."""
        steps = [
            (lane, length, (token,)) for lane, (length, token) in enumerate(zip(self.lengths, self.tokens))
        ]
        on_device = self.engine.model.device.type == "cuda"
        out = self.engine.decode_round(steps, greedy=on_device)
        self.lengths = [length + 1 for length in self.lengths]
        self.tokens = out.tolist() if on_device else sample(out, [GREEDY] * len(steps), self.lengths)

    def close(self) -> None:
        for lane in range(len(self.lengths)):
            self.engine.release(lane)


def decode_speed(engine: Engine, prompts, *, num_rounds: int, num_warmup: int = 2) -> tuple[float, float]:
    """(tokens per second over `num_rounds` decode rounds of every lane, mean KV tokens per lane)."""
    lanes = Lanes(engine, prompts, num_warmup + num_rounds)
    try:
        for _ in range(num_warmup):
            lanes.round()
        kv_before = sum(lanes.lengths)
        started = time.perf_counter()
        for _ in range(num_rounds):
            lanes.round()  # ends with the logits on the host: the round is done
        elapsed = time.perf_counter() - started
        mean_kv = (kv_before + sum(lanes.lengths)) / 2 / len(prompts)
        return len(prompts) * num_rounds / elapsed, mean_kv
    finally:
        lanes.close()


def read_bandwidth(device: torch.device, num_bytes: int) -> float:
    """Bytes per second the device reads while summing a buffer of `num_bytes` (best of three)."""
    buffer = torch.ones(num_bytes // 4, dtype=torch.float32, device=device)
    to_host(buffer.sum(), WAIT_S, "bandwidth warm-up")
    best = float("inf")
    for _ in range(3):
        started = time.perf_counter()
        to_host(buffer.sum(), WAIT_S, "bandwidth sample")
        best = min(best, time.perf_counter() - started)
    return num_bytes / best


def inspect_passes(engine: Engine, prompt: Sequence[int], num_layers: int) -> dict:
    """Which SDPA kernels a prefill and a decode round run, how many device kernels a round
    launches, and how often a round makes the host wait on the device."""
    gpu = engine.model.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])
    lanes = Lanes(engine, [prompt], 4)
    try:
        lanes.round()  # warm-up
        with profile(activities=activities) as decode:
            lanes.round()
        syncs = sync_warnings(lanes.round) if gpu else 0
    finally:
        lanes.close()
    open_lane(engine, 0, len(prompt))
    try:
        with profile(activities=activities) as prefill:
            engine.forward([(0, 0, tuple(prompt))])
    finally:
        engine.release(0)
    decode_events = Counter({e.key: e.count for e in decode.key_averages()})
    return {
        "num_layers": num_layers,
        "sdpa_prefill": _attention_ops(prefill),
        "sdpa_decode": _attention_ops(decode),
        "device_kernels_per_round": sum(e.count for e in decode.key_averages() if _on_device(e))
        if gpu
        else None,
        "host_syncs_per_round": {
            "sync_debug_warnings": syncs,
            "runtime_calls": {name: decode_events[name] for name in SYNC_CALLS if decode_events[name]},
            "note": "" if gpu else "on the CPU there is no device to wait for",
        },
    }


def sync_warnings(run) -> int:
    """How often run() makes the host wait on the device: torch's sync debug warnings (CUDA only)."""
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            run()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def _attention_ops(prof) -> dict[str, int]:
    words = ("scaled_dot_product", "flash", "fmha", "efficient_attention", "cudnn_attention")
    return {e.key: e.count for e in prof.key_averages() if any(w in e.key.lower() for w in words)}


def _on_device(event) -> bool:
    return getattr(event, "device_type", None) == torch.autograd.DeviceType.CUDA
