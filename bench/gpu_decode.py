"""The GPU check's decode rows: what a prefill and a decode round run and wait for, decode tokens/s
at each lane count against the bandwidth roofline (weights and KV read per round over the device's
measured read bandwidth), the graphs row (bench/gpu_verdicts.py), and the same speed rows for other
random geometries (`--roofline-models`: Llama 1B and 8B shapes on a GPU), each written on the spot."""

from __future__ import annotations

import time
from pathlib import Path

from bench.gpu_passes import Lanes, decode_speed, inspect_passes, one_rank, read_bandwidth
from bench.gpu_verdicts import decode_graphs, roof_verdicts
from bench.prompts import chat_prompt
from bench.random_model import GEOMETRIES, write_random_model
from bench.weight_bytes import ELEMENT_SIZES, weight_bytes_per_token
from tpserve.ranks.model_config import load_model_config
from tpserve.server.tokenizer import Tokenizer

ROOFLINE_MODELS_ON_GPU = ("1b", "8b")
GRAPH_LANES = 8  # the graphs row's round


def decode_checks(model_dir: str, args, dtype: str, prompt, lanes: list[int], context: int):
    """(what a prefill and a decode round run and wait for, decode speed against the roofline,
    launches and syncs with graphs on and off)."""
    config = load_model_config(model_dir)
    with one_rank(
        model_dir, args.device, dtype, num_lanes=max(max(lanes), GRAPH_LANES), context_size=context,
        threads=args.threads,
    ) as rt:  # fmt: skip
        passes = inspect_passes(rt.engine, prompt, config.num_layers)
        decode = speed_rows(rt, model_dir, args, dtype, lanes)
        tokenizer = Tokenizer.from_model_dir(model_dir)
        graph_lanes = Lanes(rt.engine, [chat_prompt(tokenizer, i) for i in range(GRAPH_LANES)], 8)
        try:
            graphs = decode_graphs(rt.engine, graph_lanes)
        finally:
            graph_lanes.close()
        return passes, decode, graphs


def speed_rows(rt, model_dir: str, args, dtype: str, lanes: list[int]) -> dict:
    config = load_model_config(model_dir)
    tokenizer = Tokenizer.from_model_dir(model_dir)
    bandwidth = read_bandwidth(rt.device, args.bandwidth_mib << 20)
    weights = weight_bytes_per_token(config, 0, 1, ELEMENT_SIZES[dtype])
    rows = []
    for num_lanes in lanes:
        prompts = [chat_prompt(tokenizer, i) for i in range(num_lanes)]
        rate, mean_kv = decode_speed(rt.engine, prompts, num_rounds=args.rounds)
        per_round = weights + num_lanes * mean_kv * rt.kv_budget.kv_bytes_per_token
        roof = num_lanes * bandwidth / per_round
        rows.append(
            {"lanes": num_lanes, "tokens_per_s": rate, "roofline_tokens_per_s": roof, "of_roof": rate / roof}
        )
    decode = {"dtype": dtype, "bandwidth_gb_s": bandwidth / 1e9, "weight_bytes": weights, "rows": rows}
    return roof_verdicts(decode, rt.device)


def roofline_models(args, dtype: str, device, lanes: list[int], scratch: str) -> dict:
    """Decode rows of each geometry in --roofline-models (auto: 1b and 8b on a GPU, none on the
    CPU; the checked random model's geometry left out), on a random model written under scratch
    and removed after."""
    names = args.roofline_models
    if names == "auto":  # the checked model's own rows are the decode check's
        others = [name for name in ROOFLINE_MODELS_ON_GPU if name != args.random_model]
        names = ",".join(others) if device.type == "cuda" else ""
    if names in ("", "none"):
        return {"verdict": "no CUDA (none asked)" if device.type != "cuda" else "none asked"}
    out, judged = {}, []
    for name in names.split(","):
        if name not in GEOMETRIES:
            raise ValueError(f"--roofline-models: {name!r} is not one of {', '.join(GEOMETRIES)}")
        started = time.monotonic()
        model_dir = write_random_model(Path(scratch) / f"roofline-{name}", name, device=device.type)
        tokenizer = Tokenizer.from_model_dir(model_dir)
        context = len(chat_prompt(tokenizer, max(lanes))) + args.rounds + 16
        with one_rank(
            str(model_dir), args.device, dtype, num_lanes=max(lanes), context_size=context,
            threads=args.threads,
        ) as rt:  # fmt: skip
            out[name] = speed_rows(rt, str(model_dir), args, dtype, lanes)
        out[name]["seconds"] = time.monotonic() - started
        judged.append(out[name]["verdict"])
        for file in Path(model_dir).iterdir():  # the disk is small: one geometry's files at a time
            file.unlink()
    out["verdict"] = "pass" if all(v == "pass" for v in judged) else next(v for v in judged if v != "pass")
    return out
