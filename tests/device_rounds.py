"""Decode rounds on two real CPU ranks whose leader is told it is on a GPU (the device-sampling
tests): the tokens a few lanes decode with the leader sampling as on the CPU, as on a GPU, and as on
the CPU again."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from tiny_models import write_tiny_model

from tpserve.generate import single_stream_leader
from tpserve.kernels.sampling_params import SamplingParams
from tpserve.ranks.settings import EngineSettings
from tpserve.server.backend import DecodeItem, PrefillItem

NUM_ROUNDS = 6
Lanes = Sequence[tuple[tuple[int, ...], SamplingParams]]  # (prompt, sampling) a lane


def decoded(leader, device_type: str, lanes: Lanes, takes_on_device) -> list[list[int]]:
    """The lanes prefilled, then NUM_ROUNDS rounds of all of them with the leader sampling as on
    `device_type` (`takes_on_device(leader, items)` says it took the round there on a GPU only); the
    lanes closed after."""
    leader.device_type = device_type
    tokens, blocks = [], 0
    for lane, (prompt, sampling) in enumerate(lanes):
        count = -(-(len(prompt) + NUM_ROUNDS + 1) // leader.block_size)
        leader.open(lane, tuple(range(blocks, blocks + count)), 0)
        blocks += count
        tokens.append([leader.prefill(PrefillItem(lane, 0, prompt, True, sampling))])
    for step in range(NUM_ROUNDS):
        items = [DecodeItem(lane, len(p) + step, tokens[lane][-1], s) for lane, (p, s) in enumerate(lanes)]
        assert takes_on_device(leader, items) == (device_type == "cuda")
        for lane, token in enumerate(leader.decode(items)):
            assert isinstance(token, int)
            tokens[lane].append(token)
    for lane in range(len(lanes)):
        leader.close(lane)
    return tokens


def host_device_host(tmp_path: Path, lanes: Lanes, takes_on_device) -> tuple[list, list, list]:
    """The lanes' tokens on a tp=2 tiny Llama sampled as on the CPU, a GPU, then the CPU again (the
    followers' messages are the same either way: they keep pace)."""
    settings = EngineSettings(
        model_dir=str(write_tiny_model(tmp_path / "llama", "llama")), device="cpu", dtype="float32",
        tp_size=2, num_lanes=len(lanes), context_size=64, batch_invariant=False, draft_tokens=0,
        kv_block_size=8, threads_per_rank=1,
    )  # fmt: skip
    with single_stream_leader(settings) as leader:
        return tuple(decoded(leader, kind, lanes, takes_on_device) for kind in ("cpu", "cuda", "cpu"))
