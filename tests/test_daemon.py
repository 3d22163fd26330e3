"""The real daemon as users start and call it: two ranks over gloo on loopback, a real gRPC client.

Most tests serve a tiny random model whose vocabulary (259 tokens) and context (64) are those the
golden error files name; the README flow serves the real default model (slow).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from daemon import (
    NOT_SERVING,
    SERVING,
    BackgroundReply,
    children_of,
    cmdline,
    daemon_env,
    one_lane_args,
    read_reply,
    running_daemon,
    wait_until,
    write_daemon_model,
)
from google.protobuf import descriptor_pool, message_factory, text_format
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase
from test_grpc_api import GOLDEN_DIR, read_golden

from tpserve import __version__
from tpserve.server.config import load_config
from tpserve.server.tokenizer import Tokenizer
from tpserve.v1 import serving_pb2

CONTEXT = 64  # the golden files' context
LONG_CONTEXT = 4096  # room for replies that take many seconds however fast the machine
LONG_REPLY = 4000
FREED_WITHIN_S = 30.0  # a hang guard for a cancelled or timed-out lane; its reply says it was cut
LENGTH = serving_pb2.FINISH_REASON_LENGTH


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_daemon_model(tmp_path_factory.mktemp("daemon-model"))


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return Tokenizer.from_model_dir(model_dir)


@pytest.fixture(scope="module")
def daemon(model_dir, tmp_path_factory):
    """The golden files' `default` server: context 64, two lanes, no --vision."""
    log_dir = tmp_path_factory.mktemp("daemon-logs")
    with running_daemon("spawn", model_dir, log_dir, "--context", str(CONTEXT), "--lanes", "2") as served:
        yield served


@pytest.fixture(scope="module")
def one_lane_daemon(model_dir, tmp_path_factory):
    """One lane, one queue place, long replies: for cancels, deadlines and the golden `full` state."""
    log_dir = tmp_path_factory.mktemp("one-lane-logs")
    with running_daemon("spawn", model_dir, log_dir, *one_lane_args(LONG_CONTEXT)) as served:
        yield served


def long_request(**fields) -> serving_pb2.GenerateRequest:
    fields = {"prompt": "a long one", "max_tokens": LONG_REPLY, "ignore_eos": True, **fields}
    return serving_pb2.GenerateRequest(**fields)


def offline_reply(model_dir, *args: str) -> dict:
    """`tpserve generate --tp 1 --json`: the same model run offline on one rank, no gRPC."""
    command = [sys.executable, "-m", "tpserve.cli", "generate", "--model", str(model_dir), "--tp", "1"]
    command += ["--device", "cpu"]  # the CPU, also on a GPU host
    done = subprocess.run(
        [*command, *args, "--json"], capture_output=True, text=True, env=daemon_env(), timeout=120
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


# ---- --record ----


def record_requests() -> list[serving_pb2.GenerateRequest]:
    """Long greedy replies (the random tiny model falls into loops that prompt lookup guesses) and a
    sampled one; distinct prompts, so a stream's file is found by its prompt."""
    loops = [
        serving_pb2.GenerateRequest(prompt_token_ids=ids, max_tokens=44, ignore_eos=True)
        for ids in ([5, 6, 7] * 6, [9, 10] * 8, [40, 41, 42, 43] * 4)
    ]
    sampled = serving_pb2.GenerateRequest(
        prompt="the quick brown fox", max_tokens=30, temperature=0.9, seed=3
    )
    return [*loops, sampled]


def files_by_prompt(paths: list[Path]) -> dict[tuple[int, ...], str]:
    """Each stream file's text, keyed by the prompt its first prefill fed."""
    out = {}
    for path in paths:
        text = path.read_text()
        prefill = json.loads(text.splitlines()[1])
        out[tuple(prefill["token_ids"])] = text
    return out


def open_files_under(pid: int, folder: Path) -> list[str]:
    names = []
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith(str(folder)):
            names.append(target)
    return names


def test_recording_with_drafts_on_changes_no_reply_and_writes_each_streams_solo_file(
    daemon, model_dir, tmp_path
):
    # The daemon's defaults draft tokens on the CPU; with --record they stay on. No prompt cache:
    # the second run would otherwise restore the first run's prompts (a `restore` line of its own).
    record_dir = tmp_path / "record"
    args = (
        "--context",
        str(CONTEXT),
        "--lanes",
        "2",
        "--record",
        str(record_dir),
        "--prefix-caching",
        "false",
    )
    requests = record_requests()

    def generate(stub, request):
        return read_reply(stub.Generate(request, timeout=60))

    with running_daemon("spawn", model_dir, tmp_path / "logs", *args) as recorded:
        alone = [generate(recorded.stub, request) for request in requests]  # each alone: solo runs
        with ThreadPoolExecutor(len(requests)) as pool:
            together = list(pool.map(lambda request: generate(recorded.stub, request), requests))
        recorded.wait_idle()
        values = recorded.metrics()
        # Every stream has ended: its file is closed (rank 0 writes them), while the daemon serves on.
        assert open_files_under(recorded.ranks()[0].pid, record_dir) == []
    assert values["tpserve_draft_tokens_accepted_total"] > 0, "drafts were checked and kept"
    plain = [generate(daemon.stub, request) for request in requests]  # unrecorded
    assert all(reply.ok for reply in plain)
    assert [r.token_ids for r in alone] == [r.token_ids for r in together] == [r.token_ids for r in plain]
    files = sorted(record_dir.glob("stream-*.jsonl"))
    assert len(files) == 2 * len(requests)
    # Streams open in whatever order the calls arrive; each joint-run file equals its solo run's.
    assert files_by_prompt(files[len(requests) :]) == files_by_prompt(files[: len(requests)])


# ---- Generate, Tokenize, Info, health, reflection ----


def test_generate_streams_the_offline_reply_token_by_token(daemon, model_dir, tokenizer):
    greedy = read_reply(
        daemon.stub.Generate(serving_pb2.GenerateRequest(prompt="hello world", max_tokens=24), timeout=30)
    )
    sampled_request = serving_pb2.GenerateRequest(max_tokens=24, temperature=0.9, top_k=40, seed=7)
    sampled_request.messages.add(role="user", content="the quick brown fox")
    sampled = read_reply(daemon.stub.Generate(sampled_request, timeout=30))

    expected_greedy = offline_reply(model_dir, "--prompt", "hello world", "--max-tokens", "24")
    expected_sampled = offline_reply(
        model_dir,
        *("--chat", "the quick brown fox", "--max-tokens", "24"),
        *("--temperature", "0.9", "--top-k", "40", "--seed", "7"),
    )
    # Two ranks over gRPC give exactly what one rank gives offline, the EOS token included (the
    # stream sends its id, never its text, and counts it).
    for reply, expected in ((greedy, expected_greedy), (sampled, expected_sampled)):
        shown = expected["token_ids"][:-1] if expected["finish_reason"] == "stop" else expected["token_ids"]
        assert reply.ok and reply.token_ids == expected["token_ids"]
        assert reply.text == tokenizer.decode(shown) == expected["text"]
        assert reply.num_token_messages > 1  # streamed, not sent in one piece
        usage = reply.last.usage
        assert usage.completion_tokens == len(expected["token_ids"])
        assert usage.total_s >= usage.time_to_first_token_s > 0
    assert greedy.token_ids != sampled.token_ids
    assert greedy.last.usage.prompt_tokens == len(expected_greedy["prompt_ids"])


def test_tokenize_matches_the_model_tokenizer(daemon, tokenizer):
    response = daemon.stub.Tokenize(serving_pb2.TokenizeRequest(text="hello wörld"), timeout=10)
    assert list(response.token_ids) == tokenizer.encode("hello wörld")
    assert response.num_tokens == len(response.token_ids) > 0
    request = serving_pb2.TokenizeRequest()
    request.messages.add(role="system", content="be brief")
    request.messages.add(role="user", content="hi")
    response = daemon.stub.Tokenize(request, timeout=10)
    expected = tokenizer.encode_chat(
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    )
    assert list(response.token_ids) == expected


def test_info_describes_the_two_rank_daemon(daemon, model_dir):
    info = daemon.stub.Info(serving_pb2.InfoRequest(), timeout=10)
    assert (info.model_name, info.tp_size, info.num_lanes) == (model_dir.name, 2, 2)
    assert (info.context_size, info.vocab_size, info.version) == (CONTEXT, 259, __version__)
    assert info.room == 2 * CONTEXT  # both lanes' contexts fit this tiny model's KV
    assert not info.vision


def test_health_is_serving(daemon):
    assert daemon.health() == SERVING
    assert daemon.health("tpserve.v1.Serving") == SERVING


def test_reflection_alone_is_enough_to_call_the_service(daemon):
    """As grpcurl does: list the services, then build a request from the served descriptors only."""
    database = ProtoReflectionDescriptorDatabase(daemon.channel)
    services = set(database.get_services())
    assert {
        "tpserve.v1.Serving",
        "grpc.health.v1.Health",
        "grpc.reflection.v1alpha.ServerReflection",
    } <= services
    pool = descriptor_pool.DescriptorPool(database)
    service = pool.FindServiceByName("tpserve.v1.Serving")
    assert {"Generate", "Tokenize", "Info"} <= set(service.methods_by_name)
    method = service.methods_by_name["Tokenize"]
    request_class = message_factory.GetMessageClass(method.input_type)
    response_class = message_factory.GetMessageClass(method.output_type)
    tokenize = daemon.channel.unary_unary(
        "/tpserve.v1.Serving/Tokenize",
        request_serializer=request_class.SerializeToString,
        response_deserializer=response_class.FromString,
    )
    response = tokenize(request_class(text="hello world"), timeout=10)
    expected = daemon.stub.Tokenize(serving_pb2.TokenizeRequest(text="hello world"), timeout=10)
    assert list(response.token_ids) == list(expected.token_ids)


# ---- cancel and deadline free the lane ----


def test_cancel_mid_stream_frees_the_lane_for_the_next_request(one_lane_daemon):
    served = one_lane_daemon
    running = BackgroundReply(served.stub, long_request())
    running.wait_tokens(5)
    assert served.metrics()["tpserve_lanes_busy"] == 1
    running.call.cancel()
    cancelled_at = time.monotonic()
    freed_after = served.wait_idle(timeout_s=FREED_WITHIN_S)
    reply = running.join()
    assert reply.code == grpc.StatusCode.CANCELLED and len(reply.token_ids) < LONG_REPLY
    # The one lane serves the next request at once.
    follow_up = read_reply(
        served.stub.Generate(serving_pb2.GenerateRequest(prompt="next", max_tokens=4), timeout=10)
    )
    assert follow_up.ok and len(follow_up.token_ids) == 4
    print(f"cancel: lane free {freed_after:.2f} s after the cancel ({time.monotonic() - cancelled_at:.2f} s)")
    served.wait_count('tpserve_requests_total{outcome="cancelled"}', 1)


def test_a_passed_deadline_ends_the_call_and_frees_the_lane(one_lane_daemon):
    served = one_lane_daemon
    reply = read_reply(served.stub.Generate(long_request(), timeout=1.0))
    assert reply.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert reply.code == grpc.StatusCode.DEADLINE_EXCEEDED and len(reply.token_ids) < LONG_REPLY
    served.wait_idle(timeout_s=FREED_WITHIN_S)


# ---- golden errors, against the real daemon ----

GOLDEN_FILES = sorted(GOLDEN_DIR.glob("*.txt"))


def golden_request(path):
    header, request_text = read_golden(path)
    rpc = header.get("rpc", "Generate")
    request_type = {"Generate": serving_pb2.GenerateRequest, "Tokenize": serving_pb2.TokenizeRequest}[rpc]
    return header, rpc, text_format.Parse(request_text, request_type())


def send_golden(served, rpc: str, request) -> tuple[str, str]:
    with pytest.raises(grpc.RpcError) as raised:
        if rpc == "Generate":
            for _ in served.stub.Generate(request, timeout=10):
                pass
        else:
            served.stub.Tokenize(request, timeout=10)
    return raised.value.code().name, raised.value.details()


@pytest.mark.parametrize("path", GOLDEN_FILES, ids=lambda path: path.stem)
def test_golden_error(path, daemon, one_lane_daemon, model_dir, tmp_path):
    header, rpc, request = golden_request(path)
    state = header.get("server", "default")
    expected = (header["code"], header["message"])
    if state == "vision":
        pytest.skip("--vision on this text-only model is refused at start-up: see test_vision_is_refused")
    if state == "llava":
        pytest.skip("needs a vision model: tests/test_vision_daemon.py sends these to a --vision daemon")
    if state == "default":
        assert send_golden(daemon, rpc, request) == expected
    elif state == "full":
        # The one lane busy with a long reply, the one queue place taken by a second request.
        running = BackgroundReply(one_lane_daemon.stub, long_request())
        running.wait_tokens(1)  # admitted: the one queue place is free for the second request
        waiting = BackgroundReply(one_lane_daemon.stub, long_request())
        try:
            wait_until(lambda: one_lane_daemon.metrics()["tpserve_queue_depth"] == 1, "a queued request", 10)
            assert send_golden(one_lane_daemon, rpc, request) == expected
        finally:
            running.call.cancel()
            waiting.call.cancel()
        one_lane_daemon.wait_idle()
    elif state == "broken":
        with running_daemon("ranks", model_dir, tmp_path, "--context", str(LONG_CONTEXT)) as served:
            live = BackgroundReply(served.stub, long_request())
            live.wait_tokens(1)
            served.signal(1, signal.SIGKILL)
            assert live.join().code == grpc.StatusCode.UNAVAILABLE
            # The broken daemon answers for a moment before it exits.
            assert send_golden(served, rpc, request) == expected
    elif state == "host_stopped":
        with running_daemon("spawn", model_dir, tmp_path, "--context", str(LONG_CONTEXT)) as served:
            live = BackgroundReply(served.stub, long_request())
            live.wait_tokens(1)
            served.signal(0, signal.SIGTERM)
            wait_until(lambda: served.health() == NOT_SERVING, "health NOT_SERVING while draining", 10)
            assert send_golden(served, rpc, request) == expected
    else:
        raise ValueError(f"{path.name}: unknown server state {state!r}")


def test_vision_is_refused_at_start_up(model_dir, tmp_path):
    with running_daemon("spawn", model_dir, tmp_path, "--vision", wait=False) as served:
        codes = served.wait_exits(timeout_s=60)
        assert codes == {"daemon": 2}
        model = Path(model_dir).name
        assert f"--vision: the model {model} (LlamaForCausalLM) has no vision tower" in served.logs()
        assert served.leftovers() == []


# ---- graceful stop ----


@pytest.mark.parametrize(
    ("layout", "how"),
    [("ranks", "SIGTERM to rank 0"), ("spawn", "SIGINT to the process group (Ctrl-C)")],
    ids=["ranks-sigterm", "spawn-ctrl-c"],
)
def test_stop_signal_drains_live_streams_then_every_rank_exits_0(model_dir, tmp_path, layout, how):
    args = ("--context", str(LONG_CONTEXT), "--grace-s", "30")
    with running_daemon(layout, model_dir, tmp_path, *args) as served:
        live = [BackgroundReply(served.stub, long_request(max_tokens=150)) for _ in range(2)]
        for reply in live:
            reply.wait_tokens(1)
        if layout == "ranks":
            served.signal(0, signal.SIGTERM)
        else:
            served.signal_group(signal.SIGINT)
        signalled_at = time.monotonic()
        wait_until(lambda: served.health() == NOT_SERVING, "health NOT_SERVING while draining", 10)
        for reply in live:
            done = reply.join(timeout_s=30)
            assert done.ok and done.finish_reason == LENGTH and len(done.token_ids) == 150
        codes = served.wait_exits()
        assert set(codes.values()) == {0}, codes
        wait_until(lambda: served.leftovers() == [], "every process of the daemon to end", 10)
        print(f"{how}: drained and exited {time.monotonic() - signalled_at:.2f} s after the signal")
    assert "follower: stop received" in served.logs()


@pytest.mark.parametrize(
    "how",
    [
        "SIGTERM to launch.sh",
        # Slow: the ranks drain SIGTERM and SIGINT alike (ranks-sigterm above), and Ctrl-C to the
        # group already sends torchrun and both ranks a signal at once in the fast suite.
        pytest.param("SIGTERM to its process group", marks=pytest.mark.slow),
        "SIGINT to its process group (Ctrl-C)",
    ],
    ids=["launcher-sigterm", "group-sigterm", "group-ctrl-c"],
)
def test_launch_sh_serves_with_torchrun_and_drains_on_a_stop_signal(model_dir, tmp_path, how):
    with running_daemon("launch", model_dir, tmp_path, "--context", str(LONG_CONTEXT)) as served:
        assert set(served.ranks()) == {0, 1}
        info = served.stub.Info(serving_pb2.InfoRequest(), timeout=10)
        assert info.tp_size == 2
        live = BackgroundReply(served.stub, long_request(max_tokens=100))
        live.wait_tokens(1)
        if how == "SIGTERM to launch.sh":
            served.signal_launcher(signal.SIGTERM)
        else:
            served.signal_group(signal.SIGINT if "SIGINT" in how else signal.SIGTERM)
        signalled_at = time.monotonic()
        done = live.join(timeout_s=30)
        assert done.ok and len(done.token_ids) == 100
        assert served.wait_exits() == {"launch": 0}
        print(f"{how}: drained and exited {time.monotonic() - signalled_at:.2f} s after it")
        wait_until(lambda: served.leftovers() == [], "every process of the daemon to end", 10)
    logs = served.logs()
    assert "follower: stop received" in logs and "rank0 INFO tpserve.server.daemon: stopped" in logs
    assert "Traceback" not in logs


def test_ctrl_c_reaches_launch_sh_started_while_a_library_runs_system(model_dir, tmp_path):
    # glibc's system() in another thread ignores SIGINT in this process while its command runs: a
    # launch.sh forked then must still start as from a shell, and drain on Ctrl-C.
    busy = threading.Thread(target=os.system, args=("exec sleep 300",))
    busy.start()

    def sleeping() -> list[int]:
        return [pid for pid in children_of(os.getpid()) if "sleep 300" in cmdline(pid)]

    wait_until(sleeping, "system()", 30)
    try:
        with running_daemon("launch", model_dir, tmp_path, wait=False) as served:
            served.wait_serving()
            served.signal_group(signal.SIGINT)
            assert served.wait_exits() == {"launch": 0}
    finally:
        for pid in sleeping():
            os.kill(pid, signal.SIGKILL)
        busy.join()
    assert "launch.sh: SIGINT received" in served.logs()


# ---- the README's flow, on the real default model ----


@pytest.mark.slow
def test_readme_flow_launch_then_client_streams_a_reply(default_model, tmp_path):
    """`make serve` (launch.sh with configs/default.yaml), then `tpserve client --prompt` elsewhere."""
    prompt = "The capital of France is"
    with running_daemon("launch", default_model, tmp_path, "--config", "configs/default.yaml") as served:
        client = subprocess.run(
            [sys.executable, "-m", "tpserve.cli", "client", "--target", served.target, "--prompt", prompt]
            + ["--max-tokens", "16"],
            capture_output=True,
            text=True,
            env=daemon_env(),
            timeout=120,
        )
    assert client.returncode == 0, client.stderr
    quantize = load_config("configs/default.yaml", {}, environ={}).quantize  # the same weights offline
    expected = offline_reply(default_model, "--prompt", prompt, "--max-tokens", "16", "--quantize", quantize)
    assert client.stdout == expected["text"] + "\n"
    assert client.stderr.startswith(f"[{expected['finish_reason']}: ")
