"""Run a function in N real processes joined by a gloo process group: the multi-rank test harness.

`run_ranks(fn, ...)` starts fresh processes for one function; `RankPool` keeps a group alive across
the tests of a module (starting one costs seconds). Either way `fn` must be a module-level function
(it is pickled); each rank calls `fn(ctx, *args)` with a `RankContext`, and `run` returns the
per-rank results in rank order. A rank that raises, dies or hangs fails the call with a `RanksFailed`
naming every rank: its traceback, its exit code, or that it did not answer in time (then the
processes are killed and the pool starts afresh on its next `run`).

Every rank runs one torch thread, TORCH_DISTRIBUTED_DEBUG=DETAIL and a short process-group timeout,
so a collective mismatch shows up as a clear failure rather than a hang.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import queue
import time
import traceback
from collections.abc import Callable, Collection
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from tpserve.ranks.collectives_choice import choose_collectives
from tpserve.ranks.local_ranks import free_port

__all__ = ["Exited", "RankContext", "RankPool", "RanksFailed", "free_port", "run_ranks"]

HOST = "127.0.0.1"
# After the first rank fails, how long the others get to report before they are killed: their
# own tracebacks are useful, but a peer stuck in a collective would only answer at its timeout.
FAILURE_GRACE_S = 1.0
POLL_S = 0.1


@dataclass(frozen=True)
class RankContext:
    """What `fn` gets on each rank. `store` is the group's TCPStore client (the launcher's store)."""

    rank: int
    world_size: int
    store: dist.Store
    pg_timeout_s: float


def world_collectives(ctx: RankContext, choice: str, timeout_s: float = 30.0, **options):
    """The forward collectives `choice` picks for this rank, over the pool's world group, on the CPU."""
    return choose_collectives(
        choice,
        rank=ctx.rank,
        world_size=ctx.world_size,
        device=torch.device("cpu"),
        model_group=dist.group.WORLD,
        control_group=dist.group.WORLD,
        timeout_s=timeout_s,
        **options,
    )


@dataclass(frozen=True)
class Exited:
    """The result of a rank named in `may_exit` that exited instead of returning."""

    code: int


class RanksFailed(AssertionError):
    """One or more ranks raised, died or hung; the message holds every rank's report."""


def run_ranks(
    fn: Callable[..., Any],
    world_size: int = 2,
    args: tuple = (),
    timeout_s: float = 60.0,
    *,
    may_exit: Collection[int] = (),
    pg_timeout_s: float = 10.0,
    store_on_rank0: bool = False,
) -> list[Any]:
    """Run `fn(ctx, *args)` once on `world_size` fresh processes; `timeout_s` includes start-up."""
    deadline = time.monotonic() + timeout_s
    with RankPool(world_size, pg_timeout_s=pg_timeout_s, store_on_rank0=store_on_rank0) as pool:
        pool.start(timeout_s=deadline - time.monotonic())
        return pool.run(fn, *args, timeout_s=deadline - time.monotonic(), may_exit=may_exit)


class RankPool:
    """`world_size` worker processes in one gloo group, running submitted functions in lock step.

    The TCPStore is served by this (parent) process, as torchrun's agent serves it, unless
    `store_on_rank0`, where rank 0 serves it and takes it down when it dies.
    """

    def __init__(
        self,
        world_size: int = 2,
        *,
        pg_timeout_s: float = 10.0,
        start_timeout_s: float = 300.0,  # a hang guard: spawning two ranks on a busy machine is slow
        store_on_rank0: bool = False,
    ):
        self.world_size = world_size
        self.pg_timeout_s = pg_timeout_s
        self.start_timeout_s = start_timeout_s
        self.store_on_rank0 = store_on_rank0
        self._mp = multiprocessing.get_context("spawn")
        self._store: dist.TCPStore | None = None
        self._workers: list[multiprocessing.process.BaseProcess] = []
        self._tasks: list[multiprocessing.Queue] = []
        self._results: multiprocessing.Queue | None = None

    def __enter__(self) -> RankPool:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def start(self, timeout_s: float | None = None) -> None:
        """Start the workers and wait until every rank has joined the group (run() does it lazily)."""
        if self._workers:
            return
        if self.store_on_rank0:
            port = free_port()
        else:
            self._store = dist.TCPStore(
                HOST,
                0,
                is_master=True,
                timeout=timedelta(seconds=self.start_timeout_s),
                wait_for_workers=False,
            )
            port = self._store.port
        self._results = self._mp.Queue()
        for rank in range(self.world_size):
            tasks = self._mp.Queue()
            worker = self._mp.Process(
                target=_worker_main,
                args=(rank, self.world_size, port, self.store_on_rank0, self.pg_timeout_s,
                      self.start_timeout_s, tasks, self._results),
                name=f"rank{rank}",
                daemon=True,
            )  # fmt: skip
            worker.start()
            self._workers.append(worker)
            self._tasks.append(tasks)
        timeout_s = self.start_timeout_s if timeout_s is None else timeout_s
        self._collect("start", time.monotonic() + timeout_s, may_exit=())

    def run(
        self, fn: Callable[..., Any], *args: Any, timeout_s: float = 60.0, may_exit: Collection[int] = ()
    ) -> list[Any]:
        """Run `fn(ctx, *args)` on every rank; return the results in rank order.

        Ranks in `may_exit` may exit instead of returning (their result is `Exited(code)`); the pool
        is closed after such a run, since its group has lost a member.
        """
        task = pickle.dumps((fn, args))  # fails here, clearly, for a lambda or a nested function
        self.start()
        for tasks in self._tasks:
            tasks.put(task)
        results = self._collect(getattr(fn, "__name__", repr(fn)), time.monotonic() + timeout_s, may_exit)
        if any(isinstance(result, Exited) for result in results):
            self.close()
        return results

    def close(self) -> None:
        """Ask the workers to leave, kill any that do not, and free the store."""
        for tasks, worker in zip(self._tasks, self._workers):
            if worker.is_alive():
                tasks.put(None)
        for worker in self._workers:
            worker.join(timeout=5.0)
            if worker.is_alive():
                worker.kill()
                worker.join(timeout=5.0)
        for q in [*self._tasks, *([self._results] if self._results else [])]:
            q.close()
            q.cancel_join_thread()  # the readers are gone; never block on unsent items
        self._workers, self._tasks, self._results, self._store = [], [], None, None

    def _collect(self, what: str, deadline: float, may_exit: Collection[int]) -> list[Any]:
        """Gather one report per rank; on any failure kill every worker and raise RanksFailed."""
        reports: dict[int, tuple[str, Any]] = {}
        first_failure_at: float | None = None
        while len(reports) < self.world_size:
            try:
                rank, kind, value = self._results.get(timeout=POLL_S)
                reports[rank] = (kind, value)
            except queue.Empty:
                self._note_dead_workers(reports)
            now = time.monotonic()
            if first_failure_at is None and any(
                kind == "error" or (kind == "exited" and rank not in may_exit)
                for rank, (kind, _) in reports.items()
            ):
                first_failure_at = now
            if now > deadline or (first_failure_at is not None and now > first_failure_at + FAILURE_GRACE_S):
                break
        if len(reports) < self.world_size or first_failure_at is not None:
            self._kill()
            silent = "was still running (killed)" if first_failure_at else "did not answer in time (killed)"
            raise RanksFailed(self._describe_failure(what, reports, silent))
        return [value if kind == "ok" else Exited(value) for _, (kind, value) in sorted(reports.items())]

    def _note_dead_workers(self, reports: dict[int, tuple[str, Any]]) -> None:
        for rank, worker in enumerate(self._workers):
            if rank in reports or worker.is_alive():
                continue
            # A rank's last report may still be in the pipe when its process is already gone.
            try:
                while True:
                    got_rank, kind, value = self._results.get(timeout=POLL_S)
                    reports[got_rank] = (kind, value)
            except queue.Empty:
                pass
            if rank not in reports:
                reports[rank] = ("exited", worker.exitcode)

    def _describe_failure(self, what: str, reports: dict[int, tuple[str, Any]], silent: str) -> str:
        lines = [f"{what}: ranks failed"]
        for rank in range(self.world_size):
            kind, value = reports.get(rank, ("silent", None))
            if kind == "error":
                lines.append(f"--- rank {rank} raised:\n{value}")
            elif kind == "exited":
                lines.append(f"--- rank {rank} died with exit code {value}")
            elif kind == "silent":
                lines.append(f"--- rank {rank} {silent}")
            else:
                lines.append(f"--- rank {rank} returned {value!r}")
        return "\n".join(lines)

    def _kill(self) -> None:
        for worker in self._workers:
            if worker.is_alive():
                worker.kill()
        self.close()


def _worker_main(
    rank: int,
    world_size: int,
    port: int,
    store_on_rank0: bool,
    pg_timeout_s: float,
    start_timeout_s: float,
    tasks: multiprocessing.Queue,
    results: multiprocessing.Queue,
) -> None:
    # Read by torch.distributed at import, which already happened when this module was unpickled.
    os.environ["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"
    dist.set_debug_level_from_env()
    torch.set_num_threads(1)
    try:
        store = dist.TCPStore(
            HOST,
            port,
            world_size,
            is_master=store_on_rank0 and rank == 0,
            timeout=timedelta(seconds=start_timeout_s),
            wait_for_workers=False,
        )
        # Meet first with the long start-up timeout (a rank may still be importing torch), so the
        # group itself can keep a short one.
        store.barrier("multiproc/arrived", world_size)
        dist.init_process_group(
            "gloo", store=dist.PrefixStore("multiproc/pg", store), rank=rank, world_size=world_size,
            timeout=timedelta(seconds=pg_timeout_s),
        )  # fmt: skip
        ctx = RankContext(rank, world_size, store, pg_timeout_s)
        results.put((rank, "ok", "ready"))
        for task in _tasks_while_parent_lives(tasks):
            try:
                fn, args = pickle.loads(task)
                value = fn(ctx, *args)
                pickle.dumps(value)  # an unpicklable result fails here, not silently in the queue's thread
                results.put((rank, "ok", value))
            except BaseException:
                results.put((rank, "error", traceback.format_exc()))
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))
    finally:
        results.close()
        results.join_thread()  # else the last report can be lost at exit
    # Skip interpreter teardown: gloo's threads and a group with a dead peer can hang it.
    os._exit(0)


def _tasks_while_parent_lives(tasks: multiprocessing.Queue):
    parent = multiprocessing.parent_process()
    while parent is None or parent.is_alive():
        try:
            task = tasks.get(timeout=1.0)
        except queue.Empty:
            continue
        if task is None:
            return
        yield task
