"""Where rank 0's time per decode step goes through the daemon, against bench.ops' in-process round.

Starts the shipped daemon (configs/default.yaml, plus `--flags`) with its step timers on
(tpserve/ranks/step_profile.py, $TPSERVE_STEP_PROFILE), drives `--tokens`-token greedy replies that ignore
EOS at 1 and `--streams` streams over HTTP (`/v1/completions`, bench.peer's client) and gRPC, and
reads the timers' totals before and after each burst. Per pure decode step (no prompt pass in it) it
prints each part's wall time and the scheduling thread's CPU time in it: the wire send, the forward
pass (with its vote and the follower's collectives), sampling, logprobs, the step's plan (drafts
and blocks chosen, tpserve/server/step_plan.py), the streams' per-token work (job.accept: detokenize, stop
strings, events), what is left of the step (the scheduler's bookkeeping: lanes, blocks), the gap between two steps, and the CPU the process's
other threads (the APIs) took per step. A part's wall time beyond its CPU time is waiting: for the
GIL or for the core. First, in the same run, `python -m bench.ops` times the in-process round at
the same lane counts; `daemon / ops` is the through-the-daemon step (step + gap) over it (issue 30's
target: at most 1.15).

    python -m bench.step_profile [--tokens 128] [--streams 16] [--flags "--draft-tokens 0"] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import default_model_dir, finish, print_table  # noqa: E402
from bench.peer import burst  # noqa: E402
from bench.peer_servers import REPO, start_tpserve  # noqa: E402
from tpserve.kernels.machine import machine_facts  # noqa: E402
from tpserve.ranks.step_profile import PROFILE_ENV  # noqa: E402

SETTLE_S = 0.5  # the timers flush when the engine goes idle; a snapshot unchanged this long is final
SNAPSHOT_TIMEOUT_S = 30.0
PARTS = ("wire send", "forward (and vote)", "sample", "logprobs", "plan", "tokens")


def read_settled(path: Path) -> dict:
    """The timers' totals once the engine is idle (two reads SETTLE_S apart agree)."""
    deadline = time.monotonic() + SNAPSHOT_TIMEOUT_S
    last = None
    while time.monotonic() < deadline:
        time.sleep(SETTLE_S)
        try:
            now = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if last is not None and now["steps"] == last["steps"]:
            return now
        last = now
    raise RuntimeError(f"the daemon's step timers in {path} did not settle in {SNAPSHOT_TIMEOUT_S:.0f} s")


def per_step(before: dict, after: dict) -> dict:
    """Milliseconds per pure decode step between two snapshots: [wall, cpu] per part."""
    steps = after["steps"]["decode"] - before["steps"]["decode"]
    if steps < 1:
        raise RuntimeError("no decode step ran between the snapshots")

    def delta(name: str) -> list[float]:
        a = after["parts"]["decode"].get(name, [0.0, 0.0])
        b = before["parts"]["decode"].get(name, [0.0, 0.0])
        return [(a[0] - b[0]) * 1e3 / steps, (a[1] - b[1]) * 1e3 / steps]

    figures = {name: delta(name) for name in PARTS}
    step = delta("step")
    figures["scheduler (rest of step)"] = [
        step[0] - sum(v[0] for v in figures.values()),
        step[1] - sum(v[1] for v in figures.values()),
    ]
    figures["between steps"] = delta("between steps")
    figures["step"] = step
    gap = figures["between steps"]
    figures["through the daemon (step + gap)"] = [step[0] + gap[0], step[1] + gap[1]]
    all_steps = steps + after["steps"]["prefill"] - before["steps"]["prefill"]
    # The process's CPU time but the scheduling thread's in steps and between them.
    others = (after["process_cpu_s"] - before["process_cpu_s"]) - (
        after["scheduler_cpu_s"] - before["scheduler_cpu_s"]
    )
    others -= gap[1] * steps / 1e3
    figures["other threads' CPU (APIs)"] = [0.0, others * 1e3 / all_steps]
    return {
        "ms": figures,
        "decode_steps": steps,
        "prefill_steps": all_steps - steps,
        "lanes_per_step": (after["lanes"]["decode"] - before["lanes"]["decode"]) / steps,
        "rows_per_step": (after["rows"]["decode"] - before["rows"]["decode"]) / steps,
    }


def ops_rounds(lanes: list[int]) -> dict[int, float]:
    """bench.ops' in-process round, ms at each lane count (rank 0 of tp=2, the shipped quantization)."""
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        argv = [sys.executable, "-m", "bench.ops", "--lanes", *map(str, lanes), "--json", out.name]
        subprocess.run(argv, cwd=REPO, check=True, stdout=subprocess.DEVNULL, timeout=900)
        report = json.loads(Path(out.name).read_text())
    return {int(n): figures["ms_per_round"] for n, figures in report["lanes"].items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--flags", default="", help="daemon flags beside configs/default.yaml")
    parser.add_argument("--protocols", nargs="+", choices=("http", "grpc"), default=["http", "grpc"])
    parser.add_argument("--json", metavar="FILE", default=None)
    args = parser.parse_args(argv)
    default_model_dir()  # prepared before anything is timed
    counts = [1, args.streams]
    report = {"machine": machine_facts(), "settings": vars(args), "ops_ms": ops_rounds(counts), "daemon": {}}
    timers = Path(tempfile.mkdtemp(prefix="step-profile-")) / "steps.json"
    os.environ[PROFILE_ENV] = str(timers)
    try:
        server = start_tpserve("daemon", shlex.split(args.flags))
    finally:
        del os.environ[PROFILE_ENV]
    generators = {"grpc": server.generate, "http": server.http_generate}
    try:
        burst(server, 1, 8, 1000)  # warm-up
        for protocol in args.protocols:
            server.generate = generators[protocol]
            report["daemon"][protocol] = {}
            for streams in counts:
                before = read_settled(timers)
                got = burst(server, streams, args.tokens, 100 * streams + (7 if protocol == "http" else 0))
                figures = per_step(before, read_settled(timers))
                figures["tok_s"] = got["tok_s"]
                figures["complete"] = got["complete"]
                report["daemon"][protocol][streams] = figures
    finally:
        server.close()
    names = [*PARTS, "scheduler (rest of step)", "between steps", "step", "through the daemon (step + gap)"]
    names.append("other threads' CPU (APIs)")
    for protocol, runs in report["daemon"].items():
        rows = [(name, *(x for n in counts for x in runs[n]["ms"][name])) for name in names]
        rows.append(("bench.ops in-process round", *(x for n in counts for x in (report["ops_ms"][n], 0.0))))
        ratios = [runs[n]["ms"]["through the daemon (step + gap)"][0] / report["ops_ms"][n] for n in counts]
        rows.append(("daemon / ops", *(x for r in ratios for x in (r, 0.0))))
        for n, ratio in zip(counts, ratios):
            runs[n]["daemon_over_ops"] = ratio
        title = f"ms per decode step on rank 0 over {protocol} ({report['machine']['cpu_model']})"
        header = ["part"]
        for n in counts:
            header += [f"{n}: wall ms", f"{n}: cpu ms"]
        print_table(title, tuple(header), rows)
        for n in counts:
            run = runs[n]
            print(
                f"  {n} streams: {run['tok_s']:.1f} tok/s, {run['decode_steps']} decode steps "
                f"({run['lanes_per_step']:.1f} lanes, {run['rows_per_step']:.1f} rows each), "
                f"{run['prefill_steps']} with a prompt pass"
            )
    incomplete = [
        f"{p} {n}" for p, runs in report["daemon"].items() for n in counts if not runs[n]["complete"]
    ]
    return finish(report, args.json, f"replies cut short: {incomplete}" if incomplete else None)


if __name__ == "__main__":
    sys.exit(main())
