"""Reliability of the real daemon (two ranks, gloo, loopback) under faults, floods and bad input.

Lost ranks, a rank that never starts, a storm of cancels, a flood past the queue, fuzzed requests,
clients that vanish, and (slow) a 60 s soak. Each test prints a `figures:` line (requests, errors
by status, recovery times); run with -s to see them.
"""

from __future__ import annotations

import json
import math
import random
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from daemon import (
    NOT_SERVING,
    SERVING,
    BackgroundReply,
    Reply,
    daemon_env,
    is_alive,
    read_reply,
    running_daemon,
    wait_until,
    write_daemon_model,
)
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from tpserve.ranks.errors import UserError
from tpserve.server.tokenizer import Tokenizer
from tpserve.v1 import serving_pb2, serving_pb2_grpc

CONTEXT = 512
VOCAB = 259
LANES = 8
DEFAULT_MAX_TOKENS = 16
ROLES = ("system", "user", "assistant", "tool")
OK_REASONS = (serving_pb2.FINISH_REASON_STOP, serving_pb2.FINISH_REASON_LENGTH)
UNAVAILABLE_WITHIN_S = 15.0
FOLLOWER_EXITS_WITHIN_S = 30.0


def figures(name: str, **values) -> None:
    print(f"figures: {name}: {json.dumps(values, sort_keys=True)}")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_daemon_model(tmp_path_factory.mktemp("reliability-model"))


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return Tokenizer.from_model_dir(model_dir)


@pytest.fixture(scope="module")
def daemon(model_dir, tmp_path_factory):
    args = ("--context", str(CONTEXT), "--lanes", str(LANES), "--default-max-tokens", str(DEFAULT_MAX_TOKENS))
    with running_daemon("spawn", model_dir, tmp_path_factory.mktemp("reliability-logs"), *args) as served:
        yield served


def long_request(max_tokens: int = 400, prompt: str = "a long one") -> serving_pb2.GenerateRequest:
    return serving_pb2.GenerateRequest(prompt=prompt, max_tokens=max_tokens, ignore_eos=True)


def generate(stub, request, timeout_s: float = 60.0):
    return read_reply(stub.Generate(request, timeout=timeout_s))


# ---- lost ranks ----


class HealthWatch:
    """Polls health on its own thread and notes when it first reads NOT_SERVING."""

    def __init__(self, served):
        self.first_not_serving: float | None = None
        self._served = served
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._done.is_set() and self.first_not_serving is None:
            try:
                if self._served.health(timeout_s=1.0) == NOT_SERVING:
                    self.first_not_serving = time.monotonic()
            except grpc.RpcError:
                pass  # gone: the daemon exited
            time.sleep(0.02)

    def stop(self) -> None:
        self._done.set()
        self._thread.join(5)


def test_follower_killed_mid_stream_fails_every_stream_with_unavailable(model_dir, tmp_path):
    # Replies long enough (4,000 tokens) that none can finish before the kill, however fast.
    args = ("--context", "4096", "--lanes", "4")
    with running_daemon("ranks", model_dir, tmp_path, *args) as served:
        # Four decoding, two queued behind them.
        replies = [BackgroundReply(served.stub, long_request(4000)) for _ in range(6)]
        wait_until(lambda: served.metrics()["tpserve_queue_depth"] == 2, "two queued requests", 20)
        # Four of them hold the lanes: whichever four reached the server first, not the first four
        # sent (the calls race), so wait for any four to stream.
        wait_until(
            lambda: sum(len(r.reply.token_ids) >= 2 for r in replies) >= 4, "four streaming replies", 60
        )
        decoding = [i for i, r in enumerate(replies) if len(r.reply.token_ids) >= 2]
        watch = HealthWatch(served)
        killed_at = served.signal(1, signal.SIGKILL) and time.monotonic()
        ended = [reply.join(timeout_s=UNAVAILABLE_WITHIN_S + 5) for reply in replies]
        codes = served.wait_exits(["rank0"])
        exited_at = time.monotonic()
        watch.stop()
        wait_until(lambda: served.leftovers() == [], "no process of the daemon left", 10)
    statuses = Counter(reply.code.name if reply.code else "OK" for reply in ended)
    last_end = max(reply.ended_at for reply in ended) - killed_at
    figures(
        "follower SIGKILL",
        streams=len(ended),
        statuses=statuses,
        streams_ended_s=round(last_end, 3),
        not_serving_s=round(watch.first_not_serving - killed_at, 3) if watch.first_not_serving else None,
        rank0_exit_s=round(exited_at - killed_at, 3),
        rank0_exit_code=codes["rank0"],
    )
    assert statuses == {"UNAVAILABLE": 6}
    assert all("the engine broke during this reply" in ended[i].details for i in decoding)
    assert last_end < UNAVAILABLE_WITHIN_S
    assert watch.first_not_serving is not None, "health never read NOT_SERVING before the daemon exited"
    assert codes["rank0"] == 1  # the broken engine's exit code, not an abort at teardown


def test_follower_killed_while_idle_is_noticed_without_a_request(model_dir, tmp_path):
    # An idle follower no longer takes rank 0's heartbeat: rank 0 learns it with no request in flight.
    dead_after_s = 4.0  # at least twice rank 0's heartbeat interval (2 s)
    args = ("--context", str(CONTEXT), "--lanes", "2", "--leader-dead-after-s", str(dead_after_s))
    with running_daemon("ranks", model_dir, tmp_path, *args) as served:
        read_reply(served.stub.Generate(serving_pb2.GenerateRequest(prompt="idle soon", max_tokens=2)))
        time.sleep(1.0)  # rank 0 has gone idle and the follower waits on the doorbell
        watch = HealthWatch(served)
        killed_at = served.signal(1, signal.SIGKILL) and time.monotonic()
        codes = served.wait_exits(["rank0"])
        exited_at = time.monotonic()
        watch.stop()
        wait_until(lambda: served.leftovers() == [], "no process of the daemon left", 10)
    figures(
        "follower SIGKILL while idle",
        not_serving_s=round(watch.first_not_serving - killed_at, 3) if watch.first_not_serving else None,
        rank0_exit_s=round(exited_at - killed_at, 3),
        rank0_exit_code=codes["rank0"],
    )
    assert watch.first_not_serving is not None, "health never read NOT_SERVING before the daemon exited"
    assert watch.first_not_serving - killed_at < UNAVAILABLE_WITHIN_S
    assert codes["rank0"] == 1


@pytest.mark.parametrize(
    ("layout", "busy"),
    [
        ("ranks", True),
        ("ranks", False),
        # Slow: a spawned follower learns of rank 0's death by the same liveness link as the ranks
        # layout's (mid-stream, above; test_channel checks the link itself), and test_daemon's
        # spawn-ctrl-c case sees every process of a spawned daemon end in the fast suite.
        pytest.param("spawn", True, marks=pytest.mark.slow),
        # torchrun keeps the store alive, but rank 0's end of the liveness link closes with it.
        pytest.param("launch", False, marks=pytest.mark.slow),
    ],
    ids=["mid-stream", "idle", "spawned-follower-mid-stream", "torchrun-idle"],
)
def test_rank0_killed_the_follower_exits_non_zero(model_dir, tmp_path, layout, busy):
    with running_daemon(layout, model_dir, tmp_path, "--context", str(CONTEXT)) as served:
        follower = served.ranks()[1]
        live = BackgroundReply(served.stub, long_request()) if busy else None
        if live is not None:
            live.wait_tokens(2)
        killed_at = served.signal(0, signal.SIGKILL) and time.monotonic()
        if layout == "ranks":
            codes = served.wait_exits(["rank1"], timeout_s=FOLLOWER_EXITS_WITHIN_S)
        else:  # a grandchild of the test: its exit code is not ours to read
            wait_until(lambda: not is_alive(follower), "the follower to exit", FOLLOWER_EXITS_WITHIN_S)
            codes = served.wait_exits(["launch"]) if layout == "launch" else {}
        exited_after = time.monotonic() - killed_at
        wait_until(lambda: served.leftovers() == [], "no process of the daemon left", 10)
        if live is not None:
            assert live.join().code == grpc.StatusCode.UNAVAILABLE
    figures(
        "rank 0 SIGKILL",
        layout=layout,
        busy=busy,
        exit_codes=codes,
        follower_exit_s=round(exited_after, 3),
    )
    assert exited_after < FOLLOWER_EXITS_WITHIN_S
    if layout == "ranks":
        assert codes["rank1"] == 1  # its own failure exit, not a signal or an abort at teardown
    if layout == "launch":
        assert codes["launch"] != 0
    # The follower says how it learned: its liveness link closed, or (first) a collective failed.
    logs = served.logs()
    assert "rank 1: rank 0 closed the liveness link (its process ended); exiting" in logs or (
        "follower stopping" in logs
    )


@pytest.mark.parametrize(
    ("started", "named"),
    [((0,), "rank 1 never arrived within 3s"), ((1,), "rank 0's store at 127.0.0.1:")],
    ids=["rank0-alone", "rank1-alone"],
)
def test_a_rank_that_never_starts_is_named_at_the_start_up_timeout(model_dir, tmp_path, started, named):
    args = ("--tp", "2", "--init-timeout-s", "3")
    with running_daemon("ranks", model_dir, tmp_path, *args, ranks_to_start=started, wait=False) as served:
        began = time.monotonic()
        codes = served.wait_exits(timeout_s=60)
        gave_up_after = time.monotonic() - began
    figures("a rank never starts", started=started, exit_codes=codes, gave_up_s=round(gave_up_after, 3))
    assert set(codes.values()) == {2}  # a start-up refusal, one clear line
    assert named in served.logs()
    # Well under the default init timeout (120 s): the 3 s given was the one kept. The margin is
    # the launch's own start (two Python processes importing torch on a busy machine).
    assert gave_up_after < 90


# ---- cancel storm ----


WORDS = ("the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "hello", "world", "tensor")


def stream_phase(reply) -> str:
    """How far a stream had come, as its client saw it."""
    if reply.token_ids:
        return "decoding"
    return "prefilled" if reply.prefilled else "queued/prefill"


def storm_specs(tokenizer, num_specs: int, rng: random.Random) -> list[serving_pb2.GenerateRequest]:
    specs = []
    for index in range(num_specs):
        request = serving_pb2.GenerateRequest(max_tokens=rng.randint(8, 40), ignore_eos=index % 3 != 0)
        text = " ".join(rng.choices(WORDS, k=rng.randint(2, 60)))
        if index % 4 == 0:
            request.messages.add(role="user", content=text)
        elif index % 4 == 1:
            request.prompt_token_ids.extend(tokenizer.encode(text))
        else:
            request.prompt = text
        if index % 2:
            request.temperature, request.top_p, request.seed = 0.8, 0.95, rng.randrange(2**40)
        specs.append(request)
    return specs


def test_cancel_storm_leaves_every_other_reply_exact_and_frees_everything(daemon, tokenizer):
    rng = random.Random(7)
    specs = storm_specs(tokenizer, 24, rng)
    solo = []
    for request in specs:  # one at a time: each reply alone on the daemon, the oracle
        reply = generate(daemon.stub, request)
        assert reply.ok and reply.finish_reason in OK_REASONS
        solo.append(reply.token_ids)

    num_requests, num_clients = 120, 32  # about a third cancelled, at every phase
    plans = []
    for index in range(num_requests):
        spec = rng.randrange(len(specs))
        if rng.random() < 1 / 3:
            moment = rng.choice(["at once", "after a delay", "after tokens"])
            plans.append((index, spec, moment, rng.uniform(0, 0.05), rng.randint(1, 30)))
        else:
            plans.append((index, spec, None, 0.0, 0))
    outcomes: dict[int, tuple] = {}

    def run_client(client_plans) -> None:
        with grpc.insecure_channel(daemon.target) as channel:
            stub = serving_pb2_grpc.ServingStub(channel)
            for index, spec, moment, delay_s, after_tokens in client_plans:
                call = stub.Generate(specs[spec], timeout=120)
                reply, seen = Reply(), {}

                def cancel(call=call, reply=reply, seen=seen) -> None:
                    if "phase" not in seen:  # what the stream had reached when cancelled
                        seen["phase"] = stream_phase(reply)
                        call.cancel()

                timer = threading.Timer(delay_s, cancel) if moment == "after a delay" else None
                if moment == "at once":
                    cancel()
                elif timer is not None:
                    timer.start()
                on_response = (
                    (lambda r, n=after_tokens, cancel=cancel: cancel() if len(r.token_ids) >= n else None)
                    if moment == "after tokens"
                    else None
                )
                read_reply(call, reply, on_response)
                if timer is not None:
                    timer.cancel()
                outcomes[index] = (spec, moment, seen.get("phase"), reply)

    started = time.monotonic()
    with ThreadPoolExecutor(num_clients) as pool:
        list(pool.map(run_client, [plans[i::num_clients] for i in range(num_clients)]))
    storm_s = time.monotonic() - started
    freed_s = daemon.wait_idle(timeout_s=10)

    statuses, phases, mismatches = Counter(), Counter(), []
    for index, (spec, moment, phase, reply) in sorted(outcomes.items()):
        statuses[reply.code.name if reply.code else "OK"] += 1
        if moment is None:
            if not reply.ok or reply.token_ids != solo[spec]:
                mismatches.append((index, spec, reply.code, reply.details))
            continue
        phases[phase if reply.code == grpc.StatusCode.CANCELLED else "finished first"] += 1
        # A cancelled reply is a prefix of its solo run; one that finished first is the whole of it.
        expected = solo[spec][: len(reply.token_ids)] if not reply.ok else solo[spec]
        if reply.token_ids != expected or reply.code not in (None, grpc.StatusCode.CANCELLED):
            mismatches.append((index, spec, reply.code, reply.details))
    values = daemon.metrics()
    figures(
        "cancel storm",
        requests=len(outcomes),
        clients=num_clients,
        statuses=statuses,
        cancel_phases=phases,
        storm_s=round(storm_s, 2),
        all_free_after_s=round(freed_s, 3),
    )
    assert len(outcomes) == num_requests
    assert mismatches == []
    assert phases["decoding"] >= 1 and phases["queued/prefill"] + phases["prefilled"] >= 1
    assert values["tpserve_lanes_busy"] == 0 and values["tpserve_room_used_tokens"] == 0
    # The storm replayed prompts the solo runs had computed, so shared blocks were used (and exact);
    # once quiet, no stream holds a block (cancelled ones included), and cached prefixes stay.
    assert values["tpserve_prompt_cache_hit_tokens_total"] > 0
    assert values["tpserve_kv_blocks_used"] == 0
    assert 0 < values["tpserve_prompt_cache_blocks"] <= values["tpserve_kv_blocks"]
    again = generate(daemon.stub, specs[0])
    assert again.ok and again.token_ids == solo[0]


# ---- flood ----


def test_a_flood_past_the_queue_is_refused_at_once_and_the_admitted_complete(model_dir, tmp_path):
    lanes, queue_size, num_clients, max_tokens = 2, 4, 40, 120
    args = ("--context", str(CONTEXT), "--lanes", str(lanes), "--queue-size", str(queue_size))
    with running_daemon("spawn", model_dir, tmp_path, *args) as served:
        barrier = threading.Barrier(num_clients)

        def one_client(index: int):
            with grpc.insecure_channel(served.target) as channel:
                stub = serving_pb2_grpc.ServingStub(channel)
                channel_ready = grpc.channel_ready_future(channel)
                channel_ready.result(timeout=30)
                barrier.wait(timeout=30)
                sent_at = time.monotonic()
                reply = read_reply(stub.Generate(long_request(max_tokens, f"flood {index}"), timeout=120))
                return sent_at, reply

        started = time.monotonic()
        with ThreadPoolExecutor(num_clients) as pool:
            results = list(pool.map(one_client, range(num_clients)))
        flood_s = time.monotonic() - started
        refused = [(sent, reply) for sent, reply in results if not reply.ok]
        admitted = [reply for _, reply in results if reply.ok]
        slowest_refusal = max((reply.ended_at - sent for sent, reply in refused), default=0.0)
        served.wait_idle()
        assert served.health() == SERVING
        after = generate(served.stub, long_request(4))
    figures(
        "flood",
        clients=num_clients,
        lanes=lanes,
        queue_size=queue_size,
        admitted=len(admitted),
        statuses=Counter(reply.code.name for _, reply in refused),
        details=Counter(reply.details for _, reply in refused),
        slowest_refusal_s=round(slowest_refusal, 3),
        flood_s=round(flood_s, 2),
    )
    assert {reply.code for _, reply in refused} == {grpc.StatusCode.RESOURCE_EXHAUSTED}
    # The queue's places were all taken (the scheduler may not yet have moved the first ones
    # into lanes when the flood filled it), and nothing ran beyond lanes and queue: a request taken
    # past them needs a place that an admitted reply freed before it came (on a busy machine a
    # client's call may come after the first replies end), so before the last first message.
    last_taken = max(reply.first_at for reply in admitted)
    freed = sum(1 for reply in admitted if reply.ended_at < last_taken)
    assert queue_size <= len(admitted) <= lanes + queue_size + freed
    assert all(len(reply.token_ids) == max_tokens for reply in admitted)
    assert slowest_refusal < 30.0  # a hang guard: the refusals' code is the check
    assert after.ok and len(after.token_ids) == 4


# ---- fuzzed requests ----

NASTY_FLOATS = st.one_of(
    st.floats(width=32, allow_nan=True, allow_infinity=True),
    st.sampled_from([math.nan, -0.0, -1.0, 1e-45, 100.0, 101.0, math.inf, -math.inf]),
)
NASTY_INTS = st.one_of(
    st.integers(-(2**31), 2**31 - 1), st.sampled_from([-1, 0, CONTEXT, CONTEXT + 1, 2**31 - 1])
)
# Each field: mostly unset or sensible (so valid requests run too), sometimes extreme or malformed.
FIELDS = {
    "max_tokens": (st.integers(1, 24), NASTY_INTS),
    "temperature": (st.floats(0, 2, width=32), NASTY_FLOATS),
    "top_p": (st.floats(0.125, 1, width=32), NASTY_FLOATS),
    "top_k": (st.integers(0, 300), NASTY_INTS),
    "min_p": (st.floats(0, 0.5, width=32), NASTY_FLOATS),
    "seed": (st.integers(0, 2**63 - 1), st.integers(2**63 - 2, 2**64 - 1)),
}
ROLE_NAMES = st.one_of(
    st.sampled_from(ROLES), st.sampled_from(["", "USER", "user ", "robot", "\x00"]), st.text(max_size=8)
)
STOPS = st.one_of(
    st.lists(st.text(min_size=1, max_size=8), max_size=3),
    st.lists(st.text(max_size=300), max_size=20),
    st.integers(1000, 3000).map(lambda n: [f"s{i}" for i in range(n)]),
)
TOKEN_IDS = st.one_of(
    st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=40),
    st.lists(
        st.one_of(st.integers(0, VOCAB - 1), st.integers(-(2**31), 2**31 - 1)),
        min_size=1,
        max_size=CONTEXT + 10,
    ),
)
PROMPTS = st.one_of(
    st.text(min_size=1, max_size=80),
    st.text(max_size=2000),
    st.integers(500_000, 1_500_000).map(lambda n: "x" * n),  # megabyte prompts
)


@st.composite
def generate_requests(draw) -> serving_pb2.GenerateRequest:
    """About half well formed (so real replies run), half with extreme or malformed values."""
    request = serving_pb2.GenerateRequest()
    wild = draw(st.booleans())
    one_input = st.sampled_from([{"prompt"}, {"messages"}, {"ids"}])
    inputs = draw(st.sets(st.sampled_from(["prompt", "messages", "ids"]), max_size=3) if wild else one_input)
    if "prompt" in inputs:
        request.prompt = draw(PROMPTS if wild else st.text(min_size=1, max_size=80))
    if "messages" in inputs:
        roles = ROLE_NAMES if wild else st.sampled_from(ROLES)
        for role, content in draw(st.lists(st.tuples(roles, st.text(max_size=50)), min_size=1, max_size=4)):
            request.messages.add(role=role, content=content)
    if "ids" in inputs:
        request.prompt_token_ids.extend(
            draw(TOKEN_IDS if wild else st.lists(st.integers(0, VOCAB - 1), min_size=1))
        )
    for name, (sensible, nasty) in FIELDS.items():
        choice = draw(st.sampled_from(["unset", "sensible", "nasty"] if wild else ["unset", "sensible"]))
        if choice != "unset":
            setattr(request, name, draw(sensible if choice == "sensible" else nasty))
    request.stop.extend(draw(STOPS if wild else st.lists(st.text(min_size=1, max_size=8), max_size=3)))
    request.ignore_eos, request.background = draw(st.booleans()), draw(st.booleans())
    return request


def expected_refusal(request, tokenizer) -> bool:
    """Whether the request breaks any rule of the API (proto comments and the issue), worked out
    here from the request alone."""
    inputs = [request.HasField("prompt"), len(request.messages) > 0, len(request.prompt_token_ids) > 0]
    if sum(inputs) != 1 or (request.HasField("prompt") and not request.prompt):
        return True
    if any(not message.role for message in request.messages):  # any other role reaches the template
        return True
    if any(not 0 <= token < VOCAB for token in request.prompt_token_ids):
        return True
    has = request.HasField
    if has("max_tokens") and not 1 <= request.max_tokens <= CONTEXT:
        return True
    if has("temperature") and not 0 <= request.temperature <= 100:
        return True
    if has("top_p") and not 0 < request.top_p <= 1:
        return True
    if (has("top_k") and request.top_k < 0) or (has("min_p") and not 0 <= request.min_p <= 1):
        return True
    if has("seed") and request.seed >= 2**63:
        return True
    if len(request.stop) > 16 or any(not 0 < len(stop) <= 256 for stop in request.stop):
        return True
    try:
        if request.HasField("prompt"):
            num_prompt = len(tokenizer.encode(request.prompt))
        elif request.messages:
            chat = [{"role": m.role, "content": m.content} for m in request.messages]
            num_prompt = len(tokenizer.encode_chat(chat))
        else:
            num_prompt = len(request.prompt_token_ids)
    except UserError:  # the chat template refused the conversation
        return True
    if has("max_tokens"):
        return num_prompt + request.max_tokens > CONTEXT
    return num_prompt >= CONTEXT


def test_fuzzed_requests_get_a_precise_status_or_a_valid_reply(daemon, tokenizer):
    normal = serving_pb2.GenerateRequest(prompt="hello world", max_tokens=12)
    before = generate(daemon.stub, normal)
    outcomes = Counter()

    @settings(
        max_examples=150,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(request=generate_requests())
    @example(request=serving_pb2.GenerateRequest(prompt="hi", max_tokens=2**31 - 1))
    @example(request=serving_pb2.GenerateRequest(prompt="hi", temperature=math.nan, top_p=-0.5, min_p=-1))
    @example(request=serving_pb2.GenerateRequest(prompt="x" * 1_000_000, max_tokens=4))
    @example(request=serving_pb2.GenerateRequest(prompt_token_ids=[5, VOCAB, -7]))
    @example(request=serving_pb2.GenerateRequest(messages=[serving_pb2.ChatMessage(role="", content="hi")]))
    @example(request=serving_pb2.GenerateRequest(messages=[serving_pb2.ChatMessage(role="narrator")]))
    @example(request=serving_pb2.GenerateRequest(prompt="hi", stop=[f"s{i}" for i in range(3000)]))
    @example(
        request=serving_pb2.GenerateRequest(messages=[serving_pb2.ChatMessage(role="user")], max_tokens=3)
    )
    def check(request):
        reply = generate(daemon.stub, request, timeout_s=60)
        outcomes[reply.code.name if reply.code else "OK"] += 1
        if expected_refusal(request, tokenizer):
            assert reply.code == grpc.StatusCode.INVALID_ARGUMENT, (reply.code, reply.details)
            assert reply.details and not reply.token_ids
        else:
            assert reply.ok, (reply.code, reply.details)
            assert reply.finish_reason in OK_REASONS
            budget = request.max_tokens if request.HasField("max_tokens") else DEFAULT_MAX_TOKENS
            assert len(reply.token_ids) <= budget
            assert all(0 <= token < VOCAB for token in reply.token_ids)

    started = time.monotonic()
    check()
    fuzz_s = time.monotonic() - started
    figures("fuzz", statuses=outcomes, requests=sum(outcomes.values()), fuzz_s=round(fuzz_s, 1))
    assert daemon.health() == SERVING
    after = generate(daemon.stub, normal)
    assert after.ok and after.token_ids == before.token_ids
    daemon.wait_idle()


# ---- a client that vanishes ----


def test_a_killed_client_frees_its_lane(daemon):
    before = daemon.metrics()
    client = subprocess.Popen(
        [sys.executable, "-m", "tpserve.cli", "client", "--target", daemon.target]
        + ["--prompt", "a long one", "--max-tokens", "500", "--ignore-eos"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=daemon_env(),
    )
    try:
        # A hang guard: the client process imports the CLI (torch) first, seconds on a busy machine.
        wait_until(lambda: daemon.metrics()["tpserve_lanes_busy"] == 1, "the client's stream to start", 120)
        client.stdout.read(1)  # its reply is flowing
    finally:
        client.kill()
        killed_at = time.monotonic()
        client.wait(10)
    freed_after = daemon.wait_idle(timeout_s=5)
    cancelled = 'tpserve_requests_total{outcome="cancelled"}'
    values = daemon.wait_count(cancelled, before.get(cancelled, 0) + 1)
    figures(
        "killed client",
        lane_free_after_s=round(freed_after, 3),
        total_s=round(time.monotonic() - killed_at, 3),
    )
    assert values.get(cancelled, 0) == before.get(cancelled, 0) + 1
    length = 'tpserve_requests_total{outcome="length"}'
    assert values.get(length, 0) == before.get(length, 0)  # its 500 tokens never all ran
    assert freed_after < 30.0  # a hang guard: the metrics above say it never ran to its end


# ---- soak ----


@pytest.mark.slow
def test_soak_32_clients_for_60_s_has_no_errors_and_stable_greedy_replies(daemon, tokenizer):
    rng = random.Random(11)
    specs = storm_specs(tokenizer, 24, rng)
    expected = [generate(daemon.stub, request).token_ids for request in specs]
    num_clients, soak_s = 32, 60.0
    statuses, differing, lock = Counter(), [], threading.Lock()
    ttfts: list[float] = []
    deadline = time.monotonic() + soak_s

    def client(seed: int) -> None:
        local = random.Random(seed)
        with grpc.insecure_channel(daemon.target) as channel:
            stub = serving_pb2_grpc.ServingStub(channel)
            while time.monotonic() < deadline:
                spec = local.randrange(len(specs))
                reply = generate(stub, specs[spec])
                with lock:
                    statuses[reply.code.name if reply.code else "OK"] += 1
                    if reply.ok:
                        ttfts.append(reply.last.usage.time_to_first_token_s)
                    if reply.token_ids != expected[spec]:
                        differing.append((spec, reply.code, reply.details))

    with ThreadPoolExecutor(num_clients) as pool:
        list(pool.map(client, range(num_clients)))
    ttfts.sort()
    figures(
        "soak",
        clients=num_clients,
        seconds=soak_s,
        statuses=statuses,
        differing=len(differing),
        ttft_p50_s=round(ttfts[len(ttfts) // 2], 3) if ttfts else None,
        ttft_p99_s=round(ttfts[int(len(ttfts) * 0.99)], 3) if ttfts else None,
    )
    assert set(statuses) == {"OK"} and statuses["OK"] > num_clients
    assert differing == []
    daemon.wait_idle()
