"""Every wait for the device has a deadline: results reach the host by polling a CUDA event.

A GPU stream that waits on an NCCL kernel whose peer is gone never finishes. A blocking copy
(`.to("cpu")`, `.item()`) would wait with it until NCCL's watchdog aborts the whole process, and
the clients would hear nothing. Polling an event instead lets a rank give up at its deadline with
an error naming who did not answer: rank 0 then fails its streams with UNAVAILABLE and exits 1.
On the CPU there is nothing to wait for.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol

import torch

FIRST_PAUSE_S = 20e-6  # a decode round's copy is done within microseconds of its last kernel
LONGEST_PAUSE_S = 1e-3


class DeviceTimeout(RuntimeError):
    """The device did not finish in time: a peer of one of its collectives is lost or hung."""


class Completion(Protocol):
    def query(self) -> bool:
        """True once the work recorded before it has finished (torch.cuda.Event's query)."""


def to_host(tensor: torch.Tensor, timeout_s: float, what: str) -> torch.Tensor:
    """`tensor` on the CPU, copied without blocking and waited for with a deadline."""
    if tensor.device.type != "cuda":
        return tensor
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    done = torch.cuda.Event()
    done.record()  # on the current stream, after the copy
    wait_for(done, timeout_s, what)
    return host


def wait_for(
    done: Completion,
    timeout_s: float,
    what: str,
    *,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> None:
    """Wait until done.query() is True; DeviceTimeout, saying `what`, past timeout_s."""
    deadline = clock() + timeout_s
    pause = FIRST_PAUSE_S
    while not done.query():
        if clock() >= deadline:
            raise DeviceTimeout(f"{what}: the device did not finish within {timeout_s:g}s")
        sleep(pause)
        pause = min(pause * 2, LONGEST_PAUSE_S)
