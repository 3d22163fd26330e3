"""A rank's stop deadline (tpserve/ranks/deadline.py): it leaves with exit code 1 at the deadline, and the
kernel ends it soon after should a native call keep the interpreter from running the deadline."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

from tpserve.ranks.deadline import BACKSTOP_S

PROGRAM = """
import ctypes, logging, time
from tpserve.ranks.deadline import leave_after
logging.basicConfig(level=logging.INFO)
leave_after(0.5, "rank 1: the test's deadline")
{wait}
"""


def run(wait: str) -> tuple[int, str, float]:
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", PROGRAM.format(wait=wait)], capture_output=True, text=True, timeout=30
    )
    return done.returncode, done.stderr, time.monotonic() - started


def test_a_rank_past_its_stop_deadline_exits_1_saying_why():
    code, stderr, took_s = run("time.sleep(20)")
    assert code == 1
    assert "rank 1: the test's deadline; exiting" in stderr
    assert took_s < 10


def test_a_rank_stuck_in_a_native_call_that_keeps_the_gil_is_ended_by_the_kernel():
    # ctypes.PyDLL keeps the GIL across the call: no Python thread can run meanwhile.
    code, stderr, took_s = run('ctypes.PyDLL("libc.so.6").sleep(20)')
    assert code == -signal.SIGALRM
    assert "exiting" not in stderr
    assert took_s < 0.5 + BACKSTOP_S + 5
