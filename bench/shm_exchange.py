"""One shared-memory all-reduce step between two CPU processes: the C exchange against Python's.

Two processes map one segment (tpserve/kernels/shared_memory.py) and all-reduce float32 tensors of a
decode pass's shapes (`--rows` x 576, the default model's hidden size) back to back, `--steps` times
each, the exchange in C (tpserve/kernels/native/shm_exchange.c) and in Python in turn, `--rounds`
times; medians of the per-step wall and CPU time. A forward pass of the default model makes 61 of
these a step. The run exits 1 unless both exchanges gave the same bits.

    python -m bench.shm_exchange [--rows 1 16 --steps 3000 --rounds 3] [--json FILE]
"""

from __future__ import annotations

import argparse
import os
import secrets
import sys
import tempfile
import time
from collections.abc import Sequence
from multiprocessing import get_context
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bench.common import finish, median, print_table  # noqa: E402
from tpserve.kernels import shared_memory  # noqa: E402

HIDDEN = 576
MODES = ("C", "Python")
REDUCES_PER_STEP = 61  # the default model's decode step: the embedding's and two a layer for 30 layers


def _run_rank(rank: int, path: str, token: bytes, rows: Sequence[int], steps: int, rounds: int, out):
    torch.set_num_threads(1)
    if rank == 0:
        segment = shared_memory.create_segment(Path(path), 2, token)
        out.put(("ready", None))
    else:
        segment = None
        while segment is None:
            segment = shared_memory.open_segment(Path(path), 2, token)
    collectives = shared_memory.SharedMemoryCollectives(segment, rank, 2, [os.getppid()] * 2, 60.0)
    exchange = collectives._native
    if exchange is None:
        raise RuntimeError("the C exchange did not build here")
    timings, sums = [], {}
    for round_index in range(rounds):
        for mode in MODES:
            collectives._native = exchange if mode == "C" else None
            for num_rows in rows:
                seeded = torch.Generator().manual_seed(rank * 1000 + num_rows)
                x = torch.randn(num_rows, HIDDEN, generator=seeded)
                part = x.clone()
                for _ in range(100):  # warm
                    collectives.all_reduce_sum(x)
                    x.copy_(part)
                wall, cpu = time.perf_counter(), time.process_time()
                for _ in range(steps):
                    collectives.all_reduce_sum(x)
                    x.copy_(part)
                wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
                timings.append((round_index, mode, num_rows, wall / steps, cpu / steps))
                sums[(mode, num_rows)] = collectives.all_reduce_sum(x).clone()
    same = all(torch.equal(sums[("C", n)], sums[("Python", n)]) for n in rows)
    out.put((rank, (timings, same)))


def run_exchange(rows: Sequence[int], steps: int, rounds: int) -> dict:
    context = get_context("spawn")
    out = context.Queue()
    directory = "/dev/shm" if Path("/dev/shm").is_dir() else tempfile.gettempdir()
    path = str(Path(directory) / f"tp-bench-{secrets.token_hex(4)}")
    token = secrets.token_bytes(shared_memory.TOKEN_BYTES)
    first = context.Process(target=_run_rank, args=(0, path, token, rows, steps, rounds, out))
    first.start()
    assert out.get(timeout=60)[0] == "ready"
    second = context.Process(target=_run_rank, args=(1, path, token, rows, steps, rounds, out))
    second.start()
    results = dict(out.get(timeout=600) for _ in range(2))
    for process in (first, second):
        process.join(60)
    Path(path).unlink(missing_ok=True)
    timings, same = results[0]
    table = []
    for num_rows in rows:
        row = {"rows": num_rows}
        for mode in MODES:
            picked = [t for t in timings if t[1] == mode and t[2] == num_rows]
            row[f"{mode}_wall_us"] = median([t[3] for t in picked]) * 1e6
            row[f"{mode}_cpu_us"] = median([t[4] for t in picked]) * 1e6
        row["python_over_c"] = row["Python_wall_us"] / row["C_wall_us"]
        row["saved_ms_per_step"] = (row["Python_wall_us"] - row["C_wall_us"]) * REDUCES_PER_STEP / 1e3
        table.append(row)
    return {"steps": steps, "rounds": rounds, "results": table, "same_bits": same and results[1][1]}


def print_report(report: dict) -> None:
    print_table(
        f"one float32 all-reduce step between two processes, median of {report['rounds']} rounds",
        ("rows", "C us", "C cpu us", "Python us", "Python cpu us", "Python / C", "saved ms a step"),
        [
            (
                r["rows"],
                r["C_wall_us"],
                r["C_cpu_us"],
                r["Python_wall_us"],
                r["Python_cpu_us"],
                r["python_over_c"],
                r["saved_ms_per_step"],
            )
            for r in report["results"]
        ],
    )
    print(f"same bits from both exchanges: {report['same_bits']}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--steps", type=int, default=3000, help="all-reduces timed per mode, size and round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args(argv)
    report = run_exchange(args.rows, args.steps, args.rounds)
    print_report(report)
    return finish(report, args.json, None if report["same_bits"] else "the exchanges gave different bits")


if __name__ == "__main__":
    raise SystemExit(main())
