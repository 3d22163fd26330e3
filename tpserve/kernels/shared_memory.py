"""All-reduce and gather between CPU ranks on one host, through one shared-memory segment.

gloo moves every collective over loopback TCP and wakes a worker thread on each side: about 0.5 ms
for the 2 KiB all-reduce of one decode step, 61 times a step for the default model. Ranks that share
a host can instead write their part into shared memory, publish a step number, and read each
other's parts once every peer has published it: tens of microseconds.

Segment layout: a 4 KiB header (a random token, then one 64-byte line per rank holding the last step
that rank published), then two buffers of one `SLOT_BYTES` slot per rank. Step s uses buffer s % 2.
Every step waits for every peer, so when a rank writes buffer s % 2 again (step s + 2) each peer
has published s + 1, which it does only after it finished reading step s: no slot is overwritten
while a peer still reads it. Tensors larger than a slot go in several steps.

A sum is taken in rank order (part 0 + part 1 + ...), identically on every rank, so all ranks hold
the same bits; for two ranks it is the sum gloo computes (float addition of two terms commutes).

The step numbers are plain stores and loads, which x86-64 keeps in program order (TSO); `usable()`
refuses other machines, where they would need fences Python cannot issue. A waiting rank spins
briefly, then yields, then sleeps; it checks that the peer's process still lives, so a dead peer is
noticed within `LIVENESS_CHECK_S` rather than at the timeout.

A float32 all-reduce (every one the forward pass makes) runs its step in one C call where the C
kernels build (tpserve/kernels/native/shm_exchange.c: the copy, the store, the spin and yield, the
sum), some 5 us against 30-60 us of interpreter and dispatch time in Python; the same bits. Only a
peer still missing after the yield comes back to Python's sleeping wait and its liveness checks.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch

from tpserve.kernels import native

HEADER_BYTES = 4096
TOKEN_BYTES = 16
LINE_WORDS = 8  # one 64-byte cache line per rank's step number, so ranks never share a line
SLOT_BYTES = 1 << 20  # one rank's part of one step: the largest decode all-reduce fits many times over
SPIN_READS = 2000  # step-number reads before yielding the core (~0.2 ms)
SPIN_S = 0.0002  # the C exchange's spin, as long
YIELD_S = 0.002  # then sched_yield until this long into the wait
SLEEP_S = 0.0001  # then sleep between reads
LIVENESS_CHECK_S = 0.02


class PeerLost(RuntimeError):
    """A peer died, or did not reach the collective in time: the collective cannot complete."""


def usable(directory: str | Path) -> bool:
    """Whether this process could use a shared segment in `directory` (Linux on x86-64)."""
    return (
        sys.platform == "linux"
        and platform.machine() in ("x86_64", "AMD64")
        and Path(directory).is_dir()
        and os.access(directory, os.W_OK)
    )


def segment_bytes(world_size: int) -> int:
    return HEADER_BYTES + 2 * world_size * SLOT_BYTES


def create_segment(path: Path, world_size: int, token: bytes) -> mmap.mmap:
    """Create the segment file (space reserved now, so a full /dev/shm fails here rather than with
    SIGBUS mid-forward) and write the token peers check that they opened the right file."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.posix_fallocate(fd, 0, segment_bytes(world_size))
        segment = mmap.mmap(fd, segment_bytes(world_size))
    except OSError:
        os.unlink(path)
        raise
    finally:
        os.close(fd)
    segment[:TOKEN_BYTES] = token
    return segment


def open_segment(path: Path, world_size: int, token: bytes) -> mmap.mmap | None:
    """The segment another rank created, or None when it is not there or not the one expected."""
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError:
        return None
    try:
        if os.fstat(fd).st_size != segment_bytes(world_size):
            return None
        segment = mmap.mmap(fd, segment_bytes(world_size))
    finally:
        os.close(fd)
    if segment[:TOKEN_BYTES] != token:
        segment.close()
        return None
    return segment


def process_alive(pid: int) -> bool:
    """Whether the process runs (a zombie, killed but not yet reaped, does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    state = stat.rpartition(")")[2].split()[0]
    return state not in ("Z", "X")


class SharedMemoryCollectives:
    """The forward pass's collectives over a mapped segment; every rank calls them in the same order."""

    def __init__(self, segment: mmap.mmap, rank: int, world_size: int, pids: list[int], timeout_s: float):
        if world_size < 2:
            raise ValueError("shared-memory collectives join two or more ranks")
        self.rank, self.world_size = rank, world_size
        self._segment = segment
        self._pids = pids
        self._timeout_s = timeout_s
        # steps[r * LINE_WORDS]: the last step rank r published.
        self._steps = np.frombuffer(segment, dtype=np.int64, count=world_size * LINE_WORDS, offset=64)
        data = torch.frombuffer(segment, dtype=torch.uint8, offset=HEADER_BYTES)
        self._slots = [
            [
                data[(buffer * world_size + r) * SLOT_BYTES : (buffer * world_size + r + 1) * SLOT_BYTES]
                for r in range(world_size)
            ]
            for buffer in range(2)
        ]
        self._step = 0
        self._peers = [r for r in range(world_size) if r != rank]
        self._native = _native_exchange()
        self._base = np.frombuffer(segment, dtype=np.uint8).ctypes.data  # the segment's address, for C

    def all_reduce_sum(self, x: torch.Tensor) -> torch.Tensor:
        """x (any shape, contiguous, on CPU) becomes the sum over ranks, in place; returns x."""
        raw = _bytes_of(x)
        if self._native is not None and x.dtype == torch.float32:
            if raw.numel() <= SLOT_BYTES:  # a decode or prompt pass's: one step, no slicing
                self._reduce_natively(x.data_ptr(), x.numel())
                return x
            floats = x.view(-1)
            for start in range(0, floats.numel(), SLOT_BYTES // 4):
                part = floats[start : start + SLOT_BYTES // 4]
                self._reduce_natively(part.data_ptr(), part.numel())
            return x
        for start in range(0, raw.numel(), SLOT_BYTES):
            part = raw[start : start + SLOT_BYTES]
            slots = self._exchange(part)
            out = part.view(x.dtype)
            torch.add(slots[0][: part.numel()].view(x.dtype), slots[1][: part.numel()].view(x.dtype), out=out)
            for slot in slots[2:]:
                out += slot[: part.numel()].view(x.dtype)
        return x

    def gather_to_first(self, x: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's x (same shape on all ranks) on rank 0, in rank order; None elsewhere."""
        raw = _bytes_of(x)
        chunks = [torch.empty_like(x) for _ in range(self.world_size)] if self.rank == 0 else None
        for start in range(0, raw.numel(), SLOT_BYTES):
            part = raw[start : start + SLOT_BYTES]
            slots = self._exchange(part)
            if chunks is not None:
                for chunk, slot in zip(chunks, slots):
                    _bytes_of(chunk)[start : start + part.numel()].copy_(slot[: part.numel()])
        return chunks

    def _exchange(self, part: torch.Tensor) -> list[torch.Tensor]:
        """Publish this rank's part as the next step; every rank's slot once all have published."""
        self._step += 1
        slots = self._slots[self._step % 2]
        slots[self.rank][: part.numel()].copy_(part)
        self._steps[self.rank * LINE_WORDS] = self._step
        for peer in self._peers:
            if self._steps[peer * LINE_WORDS] < self._step:
                self._wait(peer)
        return slots

    def _reduce_natively(self, address: int, count: int) -> None:
        """One step's sum of `count` float32 at `address` (this rank's part, then the sum), in C."""
        self._step += 1
        all_reduce, total = self._native
        missing = all_reduce(
            self._base,
            HEADER_BYTES,
            SLOT_BYTES,
            self.rank,
            self.world_size,
            self._step,
            address,
            count,
            SPIN_S,
            YIELD_S,
        )
        if missing < 0:
            return
        for peer in self._peers[self._peers.index(missing) :]:  # the C call saw those before it
            if self._steps[peer * LINE_WORDS] < self._step:
                self._wait(peer, spun=True)
        total(self._base, HEADER_BYTES, SLOT_BYTES, self.world_size, self._step, address, count)

    def _wait(self, peer: int, spun: bool = False) -> None:
        """Until `peer` published this step: spin, yield, then sleep, checking it lives (spun: the
        C exchange already spun and yielded)."""
        index, step = peer * LINE_WORDS, self._step
        for _ in range(0 if spun else SPIN_READS):
            if self._steps[index] >= step:
                return
        began = time.monotonic() - (YIELD_S if spun else 0.0)
        next_check = began + LIVENESS_CHECK_S
        while self._steps[index] < step:
            now = time.monotonic()
            if now - began < YIELD_S:
                os.sched_yield()
                continue
            time.sleep(SLEEP_S)
            if now >= next_check:
                next_check = now + LIVENESS_CHECK_S
                if not process_alive(self._pids[peer]):
                    raise PeerLost(f"rank {peer} (pid {self._pids[peer]}) died during a collective")
                if now - began > self._timeout_s:
                    raise PeerLost(
                        f"rank {peer} did not reach collective step {step} within {self._timeout_s:.0f}s"
                    )


@functools.cache
def _native_exchange():
    """The C exchange's (all_reduce, sum) entries, or None where the C kernels do not build."""
    try:
        library = native.load("shm_exchange")
    except native.NativeUnavailable:
        return None
    p, i64, f64 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_double
    all_reduce, total = library.tp_shm_all_reduce_f32, library.tp_shm_sum_f32
    all_reduce.restype, all_reduce.argtypes = i64, [p, i64, i64, i64, i64, i64, p, i64, f64, f64]
    total.restype, total.argtypes = None, [p, i64, i64, i64, i64, p, i64]
    return all_reduce, total


def _bytes_of(x: torch.Tensor) -> torch.Tensor:
    if x.device.type != "cpu" or not x.is_contiguous():
        raise ValueError("shared-memory collectives take contiguous CPU tensors")
    return x.view(-1).view(torch.uint8)
