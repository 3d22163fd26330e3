"""Start-up on real ranks: room is the smallest rank's, differing flags (or a rank refusing its
device) refuse on every rank, and a rank that never arrives is named. Each rank is a spawned process running `start_rank` itself.

The tiny "llama" variant has 3 KV heads, split 2+1: rank 0 holds twice rank 1's KV bytes per token
(512 against 256 in float32), so with equal budgets rank 0's figure is the smaller.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import queue
import socket
import time
import traceback
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from tiny_models import write_tiny_model

from tpserve.kernels.native_attention import native_unavailable
from tpserve.ranks.local_ranks import free_port
from tpserve.ranks.settings import EngineSettings
from tpserve.ranks.startup import StartupError, shutdown, start_rank

RANK0_BYTES_PER_TOKEN = 512  # 2 layers x (K, V) x 2 KV heads x head_dim 16 x 4 bytes (a float32 pool)
RANK1_BYTES_PER_TOKEN = 256  # the same with 1 KV head
JOIN_TIMEOUT_S = 60.0


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return str(write_tiny_model(tmp_path_factory.mktemp("startup") / "llama", "llama"))


def settings_for(model_dir: str, **changes) -> EngineSettings:
    base = EngineSettings(
        model_dir=model_dir,
        device="cpu",  # the CPU, also on a GPU host (tests/conftest.py: gpu tests are marked)
        num_lanes=4,
        context_size=256,
        kv_budget_bytes=(1 << 20, 1 << 20),
        kv_dtype="float32",  # the room figures below count 4 bytes a value
        threads_per_rank=1,
        init_timeout_s=20.0,
        collective_timeout_s=20.0,
    )
    return replace(base, **changes)


def _rank_worker(rank: int, tasks, results) -> None:
    """One rank for the whole module: start, report what it learned (or the error), leave the group;
    then the next start. Reusing the process spares a torch import per start."""
    torch.set_num_threads(1)
    while (task := _next_task(tasks)) is not None:
        settings, port = task
        runtime = None
        try:
            runtime = start_rank(settings, rank, 2, "127.0.0.1", port)
            report = ("ok", runtime.kv_budget, runtime.engine.kv.num_slots, runtime.engine.kv.k[0].dtype)
        except StartupError as error:
            report = ("refused", str(error), None)
        except BaseException:
            report = ("crashed", traceback.format_exc(), None)
        shutdown(runtime)  # a refusal comes after the group formed: leave it, so the next start can form one
        results.put((rank, report))
    results.close()
    results.join_thread()  # else the last report can be lost at exit


def _next_task(tasks):
    """The next task; None to leave (asked to, or the test process is gone)."""
    parent = multiprocessing.parent_process()
    while parent is None or parent.is_alive():
        with contextlib.suppress(queue.Empty):
            return tasks.get(timeout=1.0)
    return None


class RankWorkers:
    """Two spawned processes, each starting its rank on demand with the settings it is given."""

    def __init__(self):
        context = multiprocessing.get_context("spawn")
        self.results = context.Queue()
        self.tasks = [context.Queue() for _ in range(2)]
        self.processes = [
            context.Process(target=_rank_worker, args=(rank, tasks, self.results), daemon=True)
            for rank, tasks in enumerate(self.tasks)
        ]
        for process in self.processes:
            process.start()

    def start_pair(self, rank_settings: list[EngineSettings]) -> dict[int, tuple]:
        """Both ranks start, each with its own settings; every rank's report.

        Fails the test, naming the rank, when one does not report within JOIN_TIMEOUT_S.
        """
        port = free_port()
        for tasks, settings in zip(self.tasks, rank_settings):
            tasks.put((settings, port))
        reports: dict[int, tuple] = {}
        deadline = time.monotonic() + JOIN_TIMEOUT_S
        while len(reports) < 2 and time.monotonic() < deadline:
            with contextlib.suppress(queue.Empty):
                rank, report = self.results.get(timeout=0.2)
                reports[rank] = report
        missing = [rank for rank in (0, 1) if rank not in reports]
        if missing:
            self.close()
            raise AssertionError(
                f"ranks {missing} hung or died without a report within {JOIN_TIMEOUT_S:.0f}s"
            )
        return reports

    def close(self) -> None:
        for tasks, process in zip(self.tasks, self.processes):
            if process.is_alive():
                tasks.put(None)
        for process in self.processes:
            process.join(10)
            if process.is_alive():
                process.kill()
                process.join(5)


@pytest.fixture(scope="module")
def ranks():
    workers = RankWorkers()
    yield workers
    workers.close()


def test_room_is_the_smaller_ranks_with_the_uneven_split(ranks, model_dir):
    budget = RANK0_BYTES_PER_TOKEN * 320  # whole KV blocks of 32
    settings = settings_for(model_dir, kv_budget_bytes=(budget, budget))
    reports = ranks.start_pair([settings, settings])
    assert all(report[0] == "ok" for report in reports.values()), reports
    rooms = {rank: report[1] for rank, report in reports.items()}
    # Rank 0 holds two KV heads, rank 1 one: the same budget holds half as many tokens on rank 0.
    assert rooms[0].kv_bytes_per_token == RANK0_BYTES_PER_TOKEN
    assert rooms[1].kv_bytes_per_token == RANK1_BYTES_PER_TOKEN
    assert [rooms[rank].kv_tokens for rank in (0, 1)] == [320, 320]
    assert [reports[rank][2] for rank in (0, 1)] == [320, 320]  # each allocated exactly that pool


def test_auto_keeps_kv_in_float16_where_the_c_kernel_reads_it_twice_the_room_of_float32(ranks, model_dir):
    budget = RANK0_BYTES_PER_TOKEN * 320  # whole KV blocks of 32
    settings = settings_for(model_dir, kv_budget_bytes=(budget, budget), kv_dtype="auto")
    reports = ranks.start_pair([settings, settings])
    assert all(report[0] == "ok" for report in reports.values()), reports
    if native_unavailable(16, 2, torch.float32, "cpu"):  # tiled products: the weights' float32
        assert [reports[rank][3] for rank in (0, 1)] == [torch.float32] * 2
        return
    assert [reports[rank][3] for rank in (0, 1)] == [torch.float16] * 2
    assert [reports[rank][1].kv_bytes_per_token for rank in (0, 1)] == [
        RANK0_BYTES_PER_TOKEN // 2,
        RANK1_BYTES_PER_TOKEN // 2,
    ]
    assert [reports[rank][2] for rank in (0, 1)] == [640, 640]


@pytest.mark.parametrize(
    ("budgets", "room"),
    [
        ((RANK0_BYTES_PER_TOKEN * 900, RANK1_BYTES_PER_TOKEN * 256), 256),  # rank 1's budget is tighter
        ((RANK0_BYTES_PER_TOKEN * 192, RANK1_BYTES_PER_TOKEN * 700), 192),  # rank 0's budget is tighter
    ],
)
def test_room_follows_configured_per_rank_budgets(ranks, model_dir, budgets, room):
    settings = settings_for(model_dir, kv_budget_bytes=budgets)
    reports = ranks.start_pair([settings, settings])
    assert all(report[0] == "ok" for report in reports.values()), reports
    assert [reports[rank][1].kv_tokens for rank in (0, 1)] == [room, room]
    assert [reports[rank][2] for rank in (0, 1)] == [room, room]


def test_room_is_capped_at_lanes_times_context(ranks, model_dir):
    settings = settings_for(model_dir, kv_budget_bytes=(1 << 30, 1 << 30))
    reports = ranks.start_pair([settings, settings])
    assert [reports[rank][1].kv_tokens for rank in (0, 1)] == [4 * 256, 4 * 256], reports


@pytest.mark.parametrize(
    ("changes", "shown"),
    [
        ({"num_lanes": 2}, ("lanes=4", "lanes=2")),
        ({"dtype": "bfloat16"}, ("dtype=float32", "dtype=bfloat16")),
    ],
)
def test_differing_flags_refuse_on_both_ranks(ranks, model_dir, changes, shown):
    reports = ranks.start_pair([settings_for(model_dir), settings_for(model_dir, **changes)])
    for rank in (0, 1):
        kind, text, _ = reports[rank]
        assert kind == "refused", f"rank {rank}: {kind}: {text}"
        assert "different flags" in text
        # Both rows are printed, so whoever reads either rank's log sees what differs.
        assert "rank 0: model=" in text and "rank 1: model=" in text
        assert shown[0] in text and shown[1] in text


def test_no_room_refuses_on_both_ranks(ranks, model_dir):
    # Rank 1's budget holds no token at all: both ranks must refuse, not rank 1 alone.
    settings = settings_for(model_dir, kv_budget_bytes=(1 << 20, 100))
    reports = ranks.start_pair([settings, settings])
    for rank in (0, 1):
        kind, text, _ = reports[rank]
        assert kind == "refused", f"rank {rank}: {kind}: {text}"
        assert "room for only 0 KV tokens" in text


def test_a_rank_without_its_own_budget_refuses_on_both_ranks(ranks, model_dir):
    # One figure for two ranks: rank 1 has none. Both must refuse, neither crash nor hang.
    settings = settings_for(model_dir, kv_budget_bytes=(1 << 20,))
    reports = ranks.start_pair([settings, settings])
    for rank in (0, 1):
        kind, text, _ = reports[rank]
        assert kind == "refused", f"rank {rank}: {kind}: {text}"
        assert "kv_budget_bytes must give one figure per rank" in text


def test_rank_0_names_the_rank_that_never_arrived(model_dir):
    settings = settings_for(model_dir, init_timeout_s=2.0)
    started = time.monotonic()
    with pytest.raises(StartupError, match=r"rank 0: rank 1 never arrived within 2s"):
        start_rank(settings, 0, 2, "127.0.0.1", free_port())
    assert time.monotonic() - started < 60  # a hang guard: the 2 s timeout, not the default 60


def test_a_follower_names_rank_0_when_it_never_answers(model_dir):
    settings = settings_for(model_dir, init_timeout_s=2.0)
    port = free_port()
    started = time.monotonic()
    with pytest.raises(StartupError, match=rf"rank 1: rank 0's store at 127.0.0.1:{port} never answered"):
        start_rank(settings, 1, 2, "127.0.0.1", port)
    assert time.monotonic() - started < 60  # a hang guard: the 2 s timeout, not the default 60


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine where torch sees no GPU")
def test_a_rank_that_refuses_its_device_makes_both_ranks_refuse_at_once(ranks, model_dir):
    # Rank 1 demands a GPU this machine lacks; rank 0 must not wait for it until init_timeout_s.
    reports = ranks.start_pair([settings_for(model_dir), settings_for(model_dir, device="cuda")])
    kinds = {rank: reports[rank][0] for rank in (0, 1)}
    assert kinds == {0: "refused", 1: "refused"}, reports
    assert "rank 1: device is cuda, but torch" in reports[1][1]
    assert "rank 1 refused its device" in reports[0][1]
    assert "rank 0: model=" in reports[0][1] and "device=cpu" in reports[0][1]
    assert "device=refused" in reports[0][1]


def test_a_rank_whose_probe_finds_a_shape_dependent_product_refuses_on_both_ranks(ranks, model_dir):
    # Rank 1's start-up probe checks a deliberately shape-dependent product (a fault drill): it
    # names the product, and rank 0 refuses too instead of serving silently inexact.
    settings = settings_for(model_dir, shape_dependent_on_rank=1)
    reports = ranks.start_pair([settings, settings])
    assert all(report[0] == "refused" for report in reports.values()), reports
    assert "batch invariance does not hold on this machine: linear qkv (64, 96)" in reports[1][1]
    assert "--batch-invariant false" in reports[1][1]
    assert "another rank found batch invariance broken" in reports[0][1]


def test_exactness_off_skips_the_probe(ranks, model_dir):
    settings = settings_for(model_dir, shape_dependent_on_rank=1, batch_invariant=False)
    reports = ranks.start_pair([settings, settings])
    assert all(report[0] == "ok" for report in reports.values()), reports


def test_free_ports_are_outside_the_range_outgoing_connections_take_and_never_repeat():
    """A port for a test daemon's listener: an outgoing connection (gloo's, the store's) made before
    the listener binds cannot hold it, and two asks in one run never get the same one."""
    low, high = (int(n) for n in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == len(ports)
    assert not [port for port in ports if low <= port <= high]
    with socket.socket() as listener:  # each is bindable
        listener.bind(("127.0.0.1", ports[-1]))


def test_test_workers_side_by_side_pick_from_disjoint_ports(monkeypatch):
    """Two pytest-xdist workers picking ports at once: neither can hand out a port the other has
    handed out but not yet bound."""
    picked = []
    for worker in ("gw0", "gw1"):
        monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
        monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "2")
        picked.append({free_port() for _ in range(30)})
    assert {port % 2 for port in picked[0]} == {0} and {port % 2 for port in picked[1]} == {1}
