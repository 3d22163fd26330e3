"""The pair on two "hosts": rank 0 here, rank 1 in its own network namespace, a veth link between
(tests/two_hosts.py), each rank started through launch.sh with --interface, gloo forced.

What a user of two machines would notice: replies equal the one-host replies (also with latency
and loss on the link), a cut link ends every stream with UNAVAILABLE and both ranks exit non-zero
soon (the liveness link, not the collective timeout), a stop signal ends each rank within its grace
whatever the other does, the store is reachable only on the interface, a second rank 1 cannot join,
a late rank 1 is waited for and a missing one named. Each test prints a `figures:` line.
"""

from __future__ import annotations

import json
import signal
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from daemon import (
    NOT_SERVING,
    SERVING,
    BackgroundReply,
    read_reply,
    running_daemon,
    wait_until,
    write_daemon_model,
)
from two_hosts import launch_rank, running_pair, skip_reason, two_hosts

from tpserve.v1 import serving_pb2

pytestmark = pytest.mark.skipif(skip_reason() is not None, reason=skip_reason() or "")

CONTEXT = 4096  # room for replies long enough that none ends before a cut, however fast
LANES = 8
REPLY_TOKENS = 48
DEAD_AFTER_S = 5.0  # leader_dead_after_s: what the liveness link waits before declaring a peer lost
COLLECTIVE_TIMEOUT_S = 30.0  # well above it, so a test shows the heartbeat, not the timeout, at work
GRACE_S = 2.0
STOP_MARGIN_S = 10.0  # each rank's stated stop deadline is grace_s + 10 s (daemon.py, serve.py)
FAST_LOSS_S = 10.0  # the fast suite's spell of 5 % loss; the slow one runs the 60 s
ARGS = (
    "--context",
    str(CONTEXT),
    "--lanes",
    str(LANES),
    "--leader-dead-after-s",
    str(DEAD_AFTER_S),
    "--collective-timeout-s",
    str(COLLECTIVE_TIMEOUT_S),
    "--init-timeout-s",
    "60",
    "--grace-s",
    str(GRACE_S),
    # launch.sh serves configs/default.yaml, whose weights are "auto" (int8 on an x86 CPU): the
    # one-host reference, started without it, names the same.
    "--quantize",
    "auto",
)


def figures(name: str, **values) -> None:
    print(f"figures: {name}: {json.dumps(values, sort_keys=True)}")


def requests() -> list[serving_pb2.GenerateRequest]:
    """Eight requests, every other one sampled (position-keyed noise: exact wherever it runs)."""
    out = []
    for index in range(8):
        request = serving_pb2.GenerateRequest(
            prompt=f"request {index}: " + "the quick brown fox " * (index + 1),
            max_tokens=REPLY_TOKENS,
            ignore_eos=True,
        )
        if index % 2:
            request.temperature, request.top_p, request.seed = 0.9, 0.95, 1000 + index
        out.append(request)
    return out


def long_request(index: int) -> serving_pb2.GenerateRequest:
    return serving_pb2.GenerateRequest(prompt=f"long {index}", max_tokens=CONTEXT - 100, ignore_eos=True)


def concurrently(served, specs, timeout_s: float = 120.0):
    with ThreadPoolExecutor(len(specs)) as pool:
        return list(pool.map(lambda r: read_reply(served.stub.Generate(r, timeout=timeout_s)), specs))


def tokens_per_s(served, num_streams: int) -> float:
    """Decode throughput of num_streams concurrent replies (all the same length)."""
    specs = [long_request(index) for index in range(num_streams)]
    for spec in specs:
        spec.max_tokens = 64
    started = time.monotonic()
    replies = concurrently(served, specs)
    assert all(reply.ok for reply in replies), [reply.details for reply in replies]
    return sum(len(reply.token_ids) for reply in replies) / (time.monotonic() - started)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_daemon_model(tmp_path_factory.mktemp("two-hosts-model"))


@pytest.fixture(scope="module")
def one_host(model_dir, tmp_path_factory):
    """The oracle: each request alone on the one-host daemon (both ranks here, shared memory)."""
    log_dir = tmp_path_factory.mktemp("one-host-logs")
    with running_daemon("spawn", model_dir, log_dir, *ARGS) as served:
        replies = [read_reply(served.stub.Generate(request, timeout=60)) for request in requests()]
    assert all(reply.ok for reply in replies)
    return [reply.token_ids for reply in replies]


@pytest.fixture(scope="module")
def link():
    with two_hosts() as made:
        yield made


@pytest.fixture(scope="module")
def served(link, model_dir, tmp_path_factory):
    """One pair over the module's link, for the tests that leave it serving."""
    with running_pair(link, model_dir, tmp_path_factory.mktemp("pair-logs"), *ARGS) as pair:
        yield pair


@pytest.fixture
def fresh_link():
    with two_hosts() as made:
        yield made


# ---- serving over the link ----


def test_eight_concurrent_replies_over_the_link_equal_the_one_host_replies(served, one_host):
    replies = concurrently(served, requests())
    assert [reply.code for reply in replies] == [None] * 8
    assert [reply.token_ids for reply in replies] == one_host
    logs = served.logs()
    assert "rank 1: forward collectives over the process group (gloo)" in logs


def timed_replies(served) -> tuple[list, float]:
    """The eight requests at once: their replies, and the tokens per second they decoded."""
    started = time.monotonic()
    replies = concurrently(served, requests())
    return replies, sum(len(reply.token_ids) for reply in replies) / (time.monotonic() - started)


def test_20ms_latency_each_way_still_gives_equal_replies(served, link, one_host):
    # The replies checked are the figures' workload too: one run each way, not separate throughput
    # runs (every decode step pays the link's 40 ms round trip several times over).
    _, plain = timed_replies(served)
    link.shape("delay", 20)
    try:
        replies, slow = timed_replies(served)
    finally:
        link.clear()
    figures(
        "20 ms each way, 8 streams",
        tok_s_no_latency=round(plain, 1),
        tok_s_20ms=round(slow, 1),
        slowdown=round(plain / slow, 2),
    )
    assert [reply.code for reply in replies] == [None] * 8
    assert [reply.token_ids for reply in replies] == one_host


def loss_run(served, link, one_host, loss_s: float) -> None:
    """8 clients replay the requests for loss_s under 5 % loss each way: every reply exact, none fails."""
    specs = requests()
    plain = tokens_per_s(served, 8)
    link.shape("loss", 5)
    outcomes, lock = [], threading.Lock()
    deadline = time.monotonic() + loss_s
    try:

        def client(index: int) -> None:
            while time.monotonic() < deadline:
                reply = read_reply(served.stub.Generate(specs[index], timeout=120))
                with lock:
                    outcomes.append((index, reply))

        started = time.monotonic()
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(client, range(8)))
        lossy_s = time.monotonic() - started
    finally:
        link.clear()
    num_tokens = sum(len(reply.token_ids) for _, reply in outcomes)
    errors = [(index, reply.code, reply.details) for index, reply in outcomes if not reply.ok]
    differing = [index for index, reply in outcomes if reply.ok and reply.token_ids != one_host[index]]
    figures(
        "5 % loss each way",
        seconds=loss_s,
        replies=len(outcomes),
        errors=len(errors),
        differing=len(differing),
        tok_s_clean_8_streams=round(plain, 1),
        tok_s_lossy_8_streams=round(num_tokens / lossy_s, 1),
        slowdown=round(plain / (num_tokens / lossy_s), 2),
    )
    assert errors == []
    assert differing == []
    assert len(outcomes) >= 8


def test_5_percent_loss_under_8_streams_changes_no_reply(served, link, one_host):
    loss_run(served, link, one_host, FAST_LOSS_S)


@pytest.mark.slow
def test_5_percent_loss_for_60_s_under_8_streams_changes_no_reply(served, link, one_host):
    loss_run(served, link, one_host, 60.0)


def test_the_store_listens_on_the_interface_only_and_a_second_rank_1_is_refused(served, link, one_host):
    host, port = served.master.split(":")
    with socket.socket() as probe, pytest.raises(ConnectionRefusedError):
        probe.connect(("127.0.0.1", int(port)))  # the store is not on loopback (nor any other address)
    launch_rank(served, link, 1, "intruder", served.args)
    code = served.wait_exits(["intruder"], timeout_s=60)["intruder"]
    intruder_log = (served.log_dir / "intruder.log").read_text()
    assert code == 2
    assert f"rank 1: a rank 1 has already joined the pair whose store is at {host}:{port}" in intruder_log
    replies = concurrently(served, requests())
    assert [reply.token_ids for reply in replies] == one_host  # the pair never noticed


# ---- a cut link ----


def test_link_cut_mid_stream_ends_every_stream_unavailable_and_both_ranks_exit(
    fresh_link, model_dir, tmp_path
):
    with running_pair(fresh_link, model_dir, tmp_path, *ARGS) as pair:
        replies = [BackgroundReply(pair.stub, long_request(index), timeout_s=120) for index in range(8)]
        for reply in replies:
            reply.wait_tokens(2)
        cut_at = time.monotonic()
        fresh_link.cut()
        ended = [reply.join(timeout_s=COLLECTIVE_TIMEOUT_S + 10) for reply in replies]
        codes = pair.wait_exits(timeout_s=DEAD_AFTER_S + 20)
        exited_s = time.monotonic() - cut_at
        wait_until(lambda: pair.leftovers() == [], "no process of either rank left", 10)
    last_end_s = max(reply.ended_at for reply in ended) - cut_at
    figures(
        "link cut mid-stream",
        streams=len(ended),
        statuses=sorted({reply.code.name if reply.code else "OK" for reply in ended}),
        streams_ended_s=round(last_end_s, 2),
        both_exited_s=round(exited_s, 2),
        exit_codes=codes,
    )
    assert [reply.code for reply in ended] == [grpc.StatusCode.UNAVAILABLE] * 8
    assert all("no heartbeat from rank 1" in reply.details for reply in ended)
    assert last_end_s < COLLECTIVE_TIMEOUT_S + 5
    assert exited_s < DEAD_AFTER_S + 10
    assert codes == {"rank0": 1, "rank1": 1}


def test_link_cut_while_idle_both_ranks_exit_non_zero(fresh_link, model_dir, tmp_path):
    with running_pair(fresh_link, model_dir, tmp_path, *ARGS) as pair:
        assert read_reply(pair.stub.Generate(requests()[0], timeout=60)).ok
        pair.wait_idle()
        cut_at = time.monotonic()
        fresh_link.cut()
        not_serving = wait_until(
            lambda: health_or_gone(pair) != SERVING, "health to leave SERVING", DEAD_AFTER_S + 10
        )
        codes = pair.wait_exits(timeout_s=DEAD_AFTER_S + 20)
        exited_s = time.monotonic() - cut_at
        wait_until(lambda: pair.leftovers() == [], "no process of either rank left", 10)
    figures(
        "link cut while idle",
        not_serving_s=round(not_serving, 2),
        both_exited_s=round(exited_s, 2),
        exit_codes=codes,
    )
    assert exited_s < DEAD_AFTER_S + 10
    assert codes == {"rank0": 1, "rank1": 1}
    assert "rank 1: no heartbeat from rank 0" in pair.logs()


def health_or_gone(pair) -> int:
    try:
        return pair.health(timeout_s=1.0)
    except grpc.RpcError:
        return NOT_SERVING


def test_a_stop_signal_ends_each_rank_within_its_grace_whatever_the_other_does(
    fresh_link, model_dir, tmp_path
):
    # The liveness link would end both ranks in DEAD_AFTER_S; here it waits longer than the stop
    # deadline, so the deadline itself is what ends them.
    args = (*ARGS, "--leader-dead-after-s", "120")
    with running_pair(fresh_link, model_dir, tmp_path, *args) as pair:
        replies = [BackgroundReply(pair.stub, long_request(index), timeout_s=120) for index in range(2)]
        for reply in replies:
            reply.wait_tokens(2)
        fresh_link.cut()
        signalled_at = time.monotonic()
        for process in pair.launched.values():  # as stopping launch.sh on each host would
            process.send_signal(signal.SIGTERM)
        codes = pair.wait_exits(timeout_s=GRACE_S + STOP_MARGIN_S + 10)
        exited_s = time.monotonic() - signalled_at
        wait_until(lambda: pair.leftovers() == [], "no process of either rank left", 10)
        ended = [reply.join(timeout_s=10) for reply in replies]
    figures("stop signal with the link cut", both_exited_s=round(exited_s, 2), exit_codes=codes)
    assert exited_s < GRACE_S + STOP_MARGIN_S + 3
    assert codes == {"rank0": 1, "rank1": 1}  # neither can stop cleanly without the other
    assert all(reply.ended_at for reply in ended)


# ---- start-up ----


def late_rank_1(fresh_link, model_dir, tmp_path, late_s: float) -> None:
    args = (*ARGS, "--init-timeout-s", str(late_s + 60))  # rank 0 waits this long for rank 1
    with running_pair(fresh_link, model_dir, tmp_path, *args, ranks=(0,), wait=False) as pair:
        started = time.monotonic()
        wait_until(lambda: time.monotonic() - started >= late_s, f"{late_s:g} s", late_s + 1, poll_s=0.5)
        assert pair.launched["rank0"].poll() is None, "rank 0 gave up before its init timeout"
        launch_rank(pair, fresh_link, 1, "rank1", pair.args)
        serving_s = pair.wait_serving(timeout_s=60)
        reply = read_reply(pair.stub.Generate(requests()[1], timeout=60))
    figures("rank 1 started late", late_s=late_s, serving_after_rank1_s=round(serving_s, 2))
    assert reply.ok and len(reply.token_ids) == REPLY_TOKENS


def test_rank_1_started_late_is_waited_for(fresh_link, model_dir, tmp_path):
    late_rank_1(fresh_link, model_dir, tmp_path, 5.0)


@pytest.mark.slow
def test_rank_1_started_60_s_late_is_waited_for(fresh_link, model_dir, tmp_path):
    late_rank_1(fresh_link, model_dir, tmp_path, 60.0)


# Slow: test_reliability's rank0-alone case checks the same refusal (rank 0's store waiting on the
# same --init-timeout-s); this one adds only the launch.sh and --interface start path, which the
# late rank 1 and the wrong interfaces below go through in the fast suite.
@pytest.mark.slow
def test_rank_1_never_arriving_is_named(fresh_link, model_dir, tmp_path):
    args = (*ARGS, "--init-timeout-s", "3")
    with running_pair(fresh_link, model_dir, tmp_path, *args, ranks=(0,), wait=False) as pair:
        codes = pair.wait_exits(timeout_s=60)
    assert codes == {"rank0": 2}
    assert "rank 1 never arrived within 3s" in pair.logs()


@pytest.mark.parametrize(
    ("rank", "interface", "named"),
    [
        (0, "tpserve-none0", "interface 'tpserve-none0' does not exist on this host"),
        (1, "lo", "is not reachable from interface 'lo' (127.0.0.1): the route to"),
    ],
    ids=["missing-interface", "master-not-behind-it"],
)
def test_a_wrong_interface_is_refused_at_start_up(fresh_link, model_dir, tmp_path, rank, interface, named):
    with running_pair(fresh_link, model_dir, tmp_path, *ARGS, ranks=(), wait=False) as pair:
        launch_rank(pair, fresh_link, rank, f"rank{rank}", pair.args, interface=interface)
        codes = pair.wait_exits(timeout_s=60)
    assert codes == {f"rank{rank}": 2}
    assert named in pair.logs()
