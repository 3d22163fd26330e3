"""The one-shot GPU check: one command, one JSON report, under ten minutes on a GPU machine.

    python -m bench.gpu_check [--device auto|cpu|cuda] [--model DIR | --random-model tiny|1b|8b]
                              [--out gpu_check.json]

Offline, from a bare copy of the tree: `--random-model 1b` (or 8b) writes a random-weights Llama
model of that geometry on the spot (bench/random_model.py), and nothing beyond torch, numpy,
safetensors, tokenizers, jinja2, pyyaml and tqdm is imported (no gguf, no default model's package,
no pip install: the tree's tpserve/ imports as it is). Without either, the prepared default model.

It records the machine (CPU model, vector extensions, BLAS, torch and its threads; the GPU, driver,
CUDA and NCCL), then checks, each on ranks started for real:
  - tp=1 float32 logits on the device against the CPU's, and the greedy tokens of both;
  - bfloat16 generation on the device (its tokens, and how long it agrees with float32);
  (then, in the dtype the daemon serves in there: bfloat16 on a GPU, float32 on the CPU)
  - whether the start-up probe finds batch invariance holding there (`batch_invariant: true`);
  - which SDPA kernels a prefill and a decode round run, the device kernels a round launches, and
    the host syncs in a round;
  - decode tokens/s at 1, 8 and 32 lanes against the bandwidth roofline (weights and KV read per
    round over the device's measured read bandwidth);
  - with two ranks (two GPUs, or the CPU): tp=2 gives tp=1's tokens, and a follower SIGKILLed
    mid-stream ends the stream with an error naming it within the deadline;
  - the device's own rows (bench/gpu_verdicts.py): FlashInfer against SDPA in a prefill and a
    decode round, launch calls per decode round with CUDA graphs on and off and the host syncs of
    a graphed round, int4 and fp8 products against bf16 (time, largest difference), the decode
    rows' share of the roofline, the same rows for the other random geometries
    (`--roofline-models`, auto: 1b and 8b on a GPU), and the whole run under ten minutes.
Every check carries a verdict (report["verdicts"]): pass, fail, or why it was not judged there ("no
CUDA" on the CPU). It runs on the CPU too (`--device cpu`), so CI keeps it working. Exit status 1
when a check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository root (and its tpserve/) importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bench.gpu_decode import decode_checks, roofline_models  # noqa: E402
from bench.gpu_facts import gpu_facts  # noqa: E402
from bench.gpu_passes import GREEDY, greedy_tokens, one_rank, prompt_logits  # noqa: E402
from bench.gpu_verdicts import paged_kernel, quantized_products, timed_run, verdict, verdicts  # noqa: E402
from bench.prompts import chat_prompt  # noqa: E402
from bench.random_model import GEOMETRIES, num_parameters, write_random_model  # noqa: E402
from bench.tables import print_table  # noqa: E402
from tpserve.default_model import default_model_dir  # noqa: E402
from tpserve.generate import generate_tokens, open_single_lane  # noqa: E402
from tpserve.kernels.machine import machine_facts  # noqa: E402
from tpserve.ranks.errors import BackendBroken  # noqa: E402
from tpserve.ranks.leader import Leader  # noqa: E402
from tpserve.ranks.local_ranks import free_port, local_followers  # noqa: E402
from tpserve.ranks.settings import EngineSettings  # noqa: E402
from tpserve.ranks.startup import StartupError, start_rank  # noqa: E402
from tpserve.server.backend import DecodeItem, PrefillItem  # noqa: E402
from tpserve.server.tokenizer import Tokenizer  # noqa: E402

KILL_AFTER_S = 0.5  # into the stream
KILL_DEADLINE_S = 30.0  # the pair's collective_timeout_s in the kill check


def run_gpu_check(args: argparse.Namespace, model_dir: str, scratch: str) -> tuple[dict, list[str]]:
    """The report, and the checks that failed (scratch: where other geometries' models are written)."""
    tokenizer = Tokenizer.from_model_dir(model_dir)
    prompt = chat_prompt(tokenizer, 0)
    lanes = [int(n) for n in args.lanes.split(",")]
    started = time.monotonic()
    report: dict = {
        "model": model_dir,
        "random_model": args.random_model,
        "num_parameters": num_parameters(json.loads(Path(model_dir, "config.json").read_text()))
        if args.random_model
        else None,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "host": machine_facts(),
        "gpu": gpu_facts(),
        "checks": {},
    }
    checks, failed = report["checks"], []
    context = len(chat_prompt(tokenizer, max(lanes))) + args.tokens + 8

    with one_rank(
        model_dir, "cpu", "float32", num_lanes=1, context_size=context, threads=args.threads
    ) as cpu:
        reference = prompt_logits(cpu.engine, prompt)
        reference_tokens = greedy_tokens(cpu.engine, prompt, args.tokens)
    with one_rank(
        model_dir, args.device, "float32", num_lanes=1, context_size=context, threads=args.threads
    ) as rt:
        device = rt.device
        report["device"] = str(device)
        logits = prompt_logits(rt.engine, prompt)
        float32_tokens = greedy_tokens(rt.engine, prompt, args.tokens)
    checks["tp1_float32_vs_cpu"] = {
        "max_abs_diff": float((logits - reference).abs().max()),
        "max_abs_logit": float(reference.abs().max()),
        "same_argmax_rows": float((logits.argmax(-1) == reference.argmax(-1)).float().mean()),
        "greedy_tokens_equal": float32_tokens == reference_tokens,
    }
    checks["tp1_float32_vs_cpu"]["verdict"] = (
        "pass"
        if float32_tokens == reference_tokens
        else "fail"
        if device.type == "cpu"
        else "differs (float32 on a GPU rounds otherwise: see max_abs_diff)"
    )
    report["host"]["threads"] = torch.get_num_threads()  # as the ranks set it

    with one_rank(
        model_dir, args.device, "bfloat16", num_lanes=1, context_size=context, threads=args.threads
    ) as rt:
        bf16_tokens = greedy_tokens(rt.engine, prompt, args.tokens)
    agree = next((i for i, (a, b) in enumerate(zip(bf16_tokens, float32_tokens)) if a != b), len(bf16_tokens))
    checks["bf16_generation"] = {
        "tokens": bf16_tokens,
        "text": tokenizer.decode(bf16_tokens),
        "agrees_with_float32_for": agree,
        "of": len(bf16_tokens),
    }

    dtype = "bfloat16" if device.type == "cuda" else "float32"  # what the daemon serves in there
    checks["batch_invariance_probe"] = guarded(invariance_probe, model_dir, args, dtype, context)

    checks["passes"], checks["decode"], checks["decode_graphs"] = guarded(
        decode_checks, model_dir, args, dtype, prompt, lanes, context, n=3
    )
    checks["paged_kernel"] = guarded(paged_kernel, device)
    checks["quantized_products"] = guarded(quantized_products, device)
    checks["roofline_models"] = guarded(roofline_models, args, dtype, device, lanes, scratch)

    two_ranks = args.two_ranks == "yes" or (
        args.two_ranks == "auto" and (device.type == "cpu" or torch.cuda.device_count() >= 2)
    )
    if two_ranks:
        checks["tp2_equals_tp1"] = guarded(tp2_equals_tp1, model_dir, args, prompt)
        checks["follower_sigkill"] = guarded(follower_sigkill, model_dir, args, prompt, context)
    else:
        why = "one GPU here" if device.type == "cuda" else "--two-ranks no"
        checks["tp2_equals_tp1"] = checks["follower_sigkill"] = {"skipped": why}

    checks["whole_run"] = timed_run(time.monotonic() - started, device)
    report["verdicts"] = verdicts(checks)
    failed += [name for name, said in report["verdicts"].items() if said == "fail"]
    report["failed"] = failed
    report["elapsed_s"] = time.monotonic() - started
    return report, failed


def chosen_model(args: argparse.Namespace, scratch: str) -> str:
    """The model directory to check: --model, a random model written under `scratch`, or the
    prepared default model (never prepared here: that needs the `gguf` package)."""
    if args.model:
        return args.model
    if args.random_model:
        draw_on = "cuda" if args.device != "cpu" and torch.cuda.is_available() else "cpu"
        out = Path(args.random_model_dir or scratch) / f"random-{args.random_model}"
        started = time.monotonic()
        write_random_model(out, args.random_model, device=draw_on)
        print(f"random {args.random_model} model written to {out} in {time.monotonic() - started:.0f} s")
        return str(out)
    prepared = default_model_dir()
    if not (prepared / "config.json").is_file():
        raise SystemExit(
            f"gpu_check: no model: {prepared} is not prepared. Pass --random-model SIZE (one of "
            f"{', '.join(GEOMETRIES)}) to check a random model written here, --model DIR, or run "
            "`tpserve prepare` first"
        )
    return str(prepared)


def guarded(check, *args, n: int = 1):
    """check(*args), or (for each of its n results) what it raised: one failed check must not cost
    the report the others."""
    try:
        return check(*args)
    except Exception as error:  # recorded in the report, which is the point of a one-shot check
        failure = {"error": f"{type(error).__name__}: {error}"[:2000]}
        return failure if n == 1 else (failure,) * n


def invariance_probe(model_dir: str, args, dtype: str, context: int) -> dict:
    """Whether `batch_invariant: true` would start here: the start-up probe's verdict."""
    try:
        with one_rank(
            model_dir, args.device, dtype, num_lanes=1, context_size=context, threads=args.threads,
            batch_invariant=True,
        ):  # fmt: skip
            return {"dtype": dtype, "holds": True}
    except StartupError as refused:
        return {"dtype": dtype, "holds": False, "refusal": str(refused)}


def pair_settings(model_dir: str, args, tp_size: int, context: int, **changes) -> EngineSettings:
    values = dict(
        model_dir=model_dir,
        device=args.device,
        dtype="auto",
        tp_size=tp_size,
        num_lanes=1,
        context_size=context,
        batch_invariant=False,
        draft_tokens=0,
        threads_per_rank=args.threads,
    )
    return EngineSettings(**(values | changes))


def tp2_equals_tp1(model_dir: str, args, prompt) -> dict:
    context = len(prompt) + args.tokens + 1
    jobs = [(prompt, GREEDY)]
    tokens = {
        tp: generate_tokens(pair_settings(model_dir, args, tp, context), jobs, args.tokens, frozenset())[
            0
        ].token_ids
        for tp in (1, 2)
    }
    equal = tokens[1] == tokens[2]
    return {"tp1_tokens": tokens[1], "tp2_tokens": tokens[2], "equal": equal, "verdict": verdict(equal)}


def follower_sigkill(model_dir: str, args, prompt, context: int) -> dict:
    """Rank 0 decodes one stream while its follower is SIGKILLed: the stream must end with an
    error naming the follower within the deadline. Leaves rank 0's group broken: run it last."""
    settings = pair_settings(model_dir, args, 2, context + 4096, collective_timeout_s=KILL_DEADLINE_S)
    port = free_port()
    with local_followers(settings, port, join_timeout_s=5.0) as followers:
        runtime = start_rank(settings, 0, 2, "127.0.0.1", port)
        leader = Leader(
            runtime.engine, runtime.channel, num_lanes=1, context_size=settings.context_size,
            max_prefill_tokens=len(prompt), batches_prompts=False,
        )  # fmt: skip
        open_single_lane(leader, 0, len(prompt) + 4096)
        token = leader.prefill(PrefillItem(0, 0, tuple(prompt), True, GREEDY))
        killed_at: list[float] = []

        def kill() -> None:
            killed_at.append(time.monotonic())
            followers[0].kill()

        killer = threading.Timer(KILL_AFTER_S, kill)
        killer.start()
        position, error = len(prompt), None
        try:
            while position < len(prompt) + 4000:
                token = leader.decode([DecodeItem(0, position, token, GREEDY)])[0]
                position += 1
        except BackendBroken as broken:
            error = str(broken)
        seconds = time.monotonic() - killed_at[0] if killed_at else None
        killer.cancel()
    # The error names the lost rank, or "the followers" when the wire's broadcast noticed first.
    names_it = error is not None and ("rank 1" in error or "followers" in error)
    in_time = names_it and seconds is not None and seconds < KILL_DEADLINE_S + 10
    return {
        "tokens_before_error": position - len(prompt),
        "seconds_from_kill_to_error": seconds,
        "stream_error": error,
        "ended_with_error_in_time": in_time,
        "verdict": verdict(in_time),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--model", default=None, help="model directory (default: the prepared default model)")
    source.add_argument(
        "--random-model",
        choices=tuple(GEOMETRIES),
        default=None,
        help="write a random-weights Llama of this geometry and check it (offline)",
    )
    parser.add_argument(
        "--random-model-dir",
        default=None,
        help="where --random-model writes it (default: a temporary folder)",
    )
    parser.add_argument("--out", default="gpu_check.json", help="the JSON report (default: gpu_check.json)")
    parser.add_argument("--lanes", default="1,8,32", help="lane counts to time decode at")
    parser.add_argument("--tokens", type=int, default=32, help="tokens generated per exactness check")
    parser.add_argument("--rounds", type=int, default=32, help="timed decode rounds per lane count")
    parser.add_argument("--bandwidth-mib", type=int, default=1024, help="buffer summed to measure bandwidth")
    parser.add_argument("--two-ranks", choices=("auto", "yes", "no"), default="auto")
    parser.add_argument(
        "--roofline-models",
        default="auto",
        help="random geometries whose decode is timed too, comma-separated, or none (auto: 1b,8b on a GPU "
        "but the checked one, none on the CPU)",
    )
    parser.add_argument("--threads", type=int, default=0, help="torch threads per rank (0: half the cores)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="tpserve-gpu-check-") as scratch:
        report, failed = run_gpu_check(args, chosen_model(args, scratch), scratch)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    checks = report["checks"]
    rows = checks["decode"].get("rows", [])
    print_table(
        f"gpu_check on {report['device']} ({report['elapsed_s']:.0f} s)",
        ("lanes", "tok/s", "roof tok/s", "of roof"),
        [(r["lanes"], r["tokens_per_s"], r["roofline_tokens_per_s"], r["of_roof"]) for r in rows],
    )
    print(f"tp1 float32 vs CPU: max |diff| {checks['tp1_float32_vs_cpu']['max_abs_diff']:.3g}")
    print(f"SDPA in prefill: {checks['passes'].get('sdpa_prefill') or checks['passes']}")
    for name, said in report["verdicts"].items():
        print(f"  {name}: {said}")
    print(f"report written to {args.out}" + (f"; FAILED: {', '.join(failed)}" if failed else ""))
    sys.stdout.flush()
    # The kill check leaves rank 0's group with a dead peer, which interpreter teardown can trip on.
    os._exit(1 if failed else 0)


if __name__ == "__main__":
    main()
