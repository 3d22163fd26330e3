"""A deadline on a rank's stop: past it the process leaves with exit code 1, whatever it waits on.

A thread logs why and leaves at the deadline. Should the interpreter be unable to run that thread
(a native call that keeps the GIL while it waits on a peer behind a cut link), the kernel ends the
process BACKSTOP_S later (SIGALRM, whose default action ends the process and which nothing here
handles), so no rank outlives its stated grace.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import sys
import threading

__all__ = ["BACKSTOP_S", "leave_after"]

log = logging.getLogger(__name__)

BACKSTOP_S = 5.0


def leave_after(deadline_s: float, why: str) -> None:
    """From any thread: exit 1 in deadline_s (logging `why`) unless the process has ended by then."""

    def leave() -> None:
        log.error("%s; exiting", why)
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)

    timer = threading.Timer(deadline_s, leave)
    timer.daemon = True
    timer.start()
    signal.alarm(math.ceil(deadline_s + BACKSTOP_S))
