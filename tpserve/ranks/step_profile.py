"""Rank 0's own timers per engine step, for bench/step_profile.py: where a step's time goes.

Off unless the daemon starts with $TPSERVE_STEP_PROFILE naming a file (a measuring tool, not a
setting: nothing the daemon serves depends on it). When on, each part of a step (the wire send, the
forward pass, sampling, logprobs, the step's plan with its drafts, the per-token work of the streams)
adds its wall time and the scheduling thread's CPU time to running totals; what is left of a step is
the scheduler's own bookkeeping. Wall time a part spent without the thread's CPU is time it waited: for the GIL, or for
a core the API threads held. The totals go to the file (JSON, replaced whole) at most once a
second and whenever the engine goes idle; a reader takes the difference of two snapshots.

Steps that prefilled a prompt (alone or beside a decode round) count apart from pure decode steps,
so a decode step's figures are not mixed with a prompt's pass.
"""

from __future__ import annotations

import json
import os
import threading
import time
from contextlib import nullcontext
from pathlib import Path

PROFILE_ENV = "TPSERVE_STEP_PROFILE"
FLUSH_INTERVAL_S = 1.0
GAP_LIMIT_S = 0.05  # a longer gap between two steps is an idle wait, not loop overhead


class StepProfile:
    """Running totals per step kind ("decode", "prefill") and part, on the scheduling thread only."""

    enabled = True

    def __init__(self, path: str | Path):
        self._path = Path(path)
        self._totals: dict[str, dict[str, list[float]]] = {"decode": {}, "prefill": {}}
        self._steps = {"decode": 0, "prefill": 0}
        self._rows = {"decode": 0, "prefill": 0}
        self._lanes = {"decode": 0, "prefill": 0}
        self._prefilled = False
        self._step_rows = 0
        self._step_lanes = 0
        self._started = (0.0, 0.0)
        self._last_end = 0.0
        self._last_end_cpu = 0.0
        self._last_flush = 0.0
        self._thread_cpu = 0.0  # the scheduling thread's CPU time inside steps
        self._pending: dict[str, list[float]] = {}  # the current step's parts: [wall, cpu] seconds
        self._wall_start = time.perf_counter()
        self._cpu_start = time.process_time()

    def part(self, name: str) -> _Part:
        """Time a part of the current step: `with profile.part("sample"): ...`."""
        return _Part(self, name)

    def add(self, name: str, wall_s: float, cpu_s: float) -> None:
        self._pending.setdefault(name, [0.0, 0.0])
        self._pending[name][0] += wall_s
        self._pending[name][1] += cpu_s

    def begin_step(self) -> None:
        now, cpu = time.perf_counter(), time.thread_time()
        self._pending = {}  # parts timed outside a step (the idle message) are not a step's
        gap = now - self._last_end
        if self._last_end and gap < GAP_LIMIT_S:
            self._pending["between steps"] = [gap, cpu - self._last_end_cpu]
        self._prefilled = False
        self._step_rows = 0
        self._step_lanes = 0
        self._started = (now, cpu)

    def prefilled(self) -> None:
        """The current step ran a prompt's pass."""
        self._prefilled = True

    def decoded(self, num_lanes: int, num_rows: int) -> None:
        """The current step's decode round: its streams and the rows they fed (drafts included)."""
        self._step_lanes += num_lanes
        self._step_rows += num_rows

    def end_step(self, ran: bool) -> None:
        now, cpu = time.perf_counter(), time.thread_time()
        if not ran:
            self._last_end = 0.0
            return
        kind = "prefill" if self._prefilled else "decode"
        wall, thread_cpu = now - self._started[0], cpu - self._started[1]
        self._thread_cpu += thread_cpu
        parts = self._totals[kind]
        for name, (part_wall, part_cpu) in self._pending.items():
            total = parts.setdefault(name, [0.0, 0.0])
            total[0] += part_wall
            total[1] += part_cpu
        total = parts.setdefault("step", [0.0, 0.0])
        total[0] += wall
        total[1] += thread_cpu
        self._steps[kind] += 1
        self._rows[kind] += self._step_rows
        self._lanes[kind] += self._step_lanes
        self._last_end, self._last_end_cpu = now, cpu
        if now - self._last_flush > FLUSH_INTERVAL_S:
            self.flush()

    def flush(self) -> None:
        """Write the totals now (also called when the engine goes idle)."""
        self._last_flush = time.perf_counter()
        snapshot = {
            "wall_s": self._last_flush - self._wall_start,
            "process_cpu_s": time.process_time() - self._cpu_start,
            "scheduler_cpu_s": self._thread_cpu,
            "num_threads": threading.active_count(),
            "steps": dict(self._steps),
            "rows": dict(self._rows),
            "lanes": dict(self._lanes),
            "parts": {kind: {k: list(v) for k, v in parts.items()} for kind, parts in self._totals.items()},
        }
        scratch = self._path.with_name(self._path.name + ".tmp")
        scratch.write_text(json.dumps(snapshot))
        os.replace(scratch, self._path)


class _Part:
    __slots__ = ("_profile", "_name", "_wall", "_cpu")

    def __init__(self, profile: StepProfile, name: str):
        self._profile, self._name = profile, name

    def __enter__(self) -> None:
        self._wall, self._cpu = time.perf_counter(), time.thread_time()

    def __exit__(self, *exc) -> None:
        self._profile.add(self._name, time.perf_counter() - self._wall, time.thread_time() - self._cpu)


class NoProfile:
    """The profile when off: every call does nothing."""

    enabled = False
    _none = nullcontext()

    def part(self, name: str) -> nullcontext:
        return self._none

    def begin_step(self) -> None:
        pass

    def prefilled(self) -> None:
        pass

    def decoded(self, num_lanes: int, num_rows: int) -> None:
        pass

    def end_step(self, ran: bool) -> None:
        pass

    def flush(self) -> None:
        pass


def profile_from_environment(environ=os.environ) -> StepProfile | NoProfile:
    path = environ.get(PROFILE_ENV, "")
    return StepProfile(path) if path else NoProfile()
