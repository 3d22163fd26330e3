"""What a hostile or careless client can send the real daemon (two ranks, gloo, loopback), and what
must hold: huge prompts refused before any tokenizing while live streams go on and memory comes
back, malformed bodies and messages refused as 400 / INVALID_ARGUMENT with a golden error and no
traceback in the log, slow clients cut off at the configured timeouts, the key's edge cases.
Each test prints a `figures:` line; run with -s to see them.
"""

from __future__ import annotations

import codecs
import contextlib
import http.client
import json
import re
import socket
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import httpx
import pytest
from daemon import SERVING, BackgroundReply, running_daemon, wait_until, write_daemon_model
from google.protobuf.message_factory import GetMessageClass
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from peer_socket import peer_socket
from test_http_connections import closed_by_server

from tpserve.server.openai_fields import CHAT_FIELDS, FIELDS
from tpserve.server.submitter import QUEUE_FULL
from tpserve.v1 import serving_pb2

CONTEXT = 512
LONGEST_TOKEN_BYTES = 13  # the daemon model's "<|endoftext|>" (tests/test_prompt_size.py)
MAX_PROMPT_BYTES = CONTEXT * LONGEST_TOKEN_BYTES
BIG_PROMPT_CHARS = (4 << 20) - 100  # just under the HTTP body limit
HEADER_TIMEOUT_S = 3.0
BODY_TIMEOUT_S = 5.0
HTTP_TIMEOUT_ARGS = ("--http-header-timeout-s", "3", "--http-body-timeout-s", "5", "--http-keep-alive-s", "3")
CLOSE_WITHIN_S = 60.0  # generous: a close is due seconds earlier, on a busy machine


def figures(name: str, **values) -> None:
    print(f"figures: {name}: {json.dumps(values, sort_keys=True)}")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_daemon_model(tmp_path_factory.mktemp("hostile-model"))


@pytest.fixture(scope="module")
def daemon(model_dir, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("hostile-logs")
    args = ("--context", str(CONTEXT), "--lanes", "4", "--default-max-tokens", "8", *HTTP_TIMEOUT_ARGS)
    with running_daemon("spawn", model_dir, log_dir, *args) as served:
        yield served


def rss_bytes(pids: list[int]) -> int:
    total = 0
    for pid in pids:
        status = Path(f"/proc/{pid}/status").read_text()
        total += int(re.search(r"VmRSS:\s+(\d+) kB", status).group(1)) * 1024
    return total


def tracebacks(daemon) -> list[str]:
    return [line for line in daemon.logs().splitlines() if "Traceback" in line or " ERROR " in line]


def largest_gap(samples: list[tuple[float, int]]) -> float:
    """The longest time a reply's token count stood still, from (when, count) samples."""
    longest, since = 0.0, None
    for (at, count), (_, previous) in zip(samples[1:], samples, strict=False):
        since = at if since is None or count != previous else since
        longest = max(longest, at - since)
    return longest


def post(daemon, path: str, content: bytes, **kwargs) -> httpx.Response:
    headers = {"content-type": "application/json", **kwargs.pop("headers", {})}
    return httpx.post(f"{daemon.http_url}/{path}", content=content, headers=headers, timeout=120, **kwargs)


# ---- limits before work ----


def test_the_largest_prompts_are_refused_before_tokenizing_while_a_stream_goes_on(daemon):
    # Rank 0's side: its engine process and the front process that holds the bodies and tokenizes.
    rank0 = [proc.pid for proc in (daemon.ranks()[0], daemon.front()) if proc is not None]
    expected = (
        f"prompt is {BIG_PROMPT_CHARS} bytes long; no prompt over {MAX_PROMPT_BYTES} bytes can fit "
        f"the context of {CONTEXT} tokens"
    )
    bodies = [json.dumps({"prompt": digit * BIG_PROMPT_CHARS, "max_tokens": 4}).encode() for digit in "1234"]
    text = "7" * BIG_PROMPT_CHARS
    tokenize = serving_pb2.TokenizeRequest(text=text)
    live_request = serving_pb2.GenerateRequest(prompt="go", max_tokens=200, ignore_eos=True)
    # The baseline: the same calls with small prompts first, which start the server's worker threads,
    # and one whole reply like the live one (what a first reply allocates once, its KV blocks' pages
    # and the sampler's buffers, is not what the refused requests would keep).
    small = json.dumps({"prompt": "hi", "max_tokens": 1}).encode()
    with ThreadPoolExecutor(8) as pool:
        assert {
            r.status_code for r in pool.map(lambda body: post(daemon, "completions", body), [small] * 24)
        } == {200}
    daemon.stub.Tokenize(serving_pb2.TokenizeRequest(text="hi"), timeout=60)
    assert BackgroundReply(daemon.stub, live_request).join(timeout_s=120).ok
    before = rss_bytes(rank0)
    live = BackgroundReply(daemon.stub, live_request)
    live.wait_tokens(1)
    token_counts = []  # (when, tokens so far) of the live reply, sampled beside the burst
    watching = threading.Event()

    def watch():
        while not watching.is_set():
            token_counts.append((time.monotonic(), len(live.reply.token_ids)))
            time.sleep(0.005)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    started = time.monotonic()

    with ThreadPoolExecutor(8) as pool:
        responses = list(pool.map(lambda body: post(daemon, "completions", body), bodies * 3))
        responses += list(pool.map(lambda body: post(daemon, "completions", body), bodies * 3))
        with pytest.raises(grpc.RpcError) as raised:
            pool.submit(daemon.stub.Tokenize, tokenize, timeout=60).result()
        tokenize_url = f"http://127.0.0.1:{daemon.http_port}/tokenize"  # vLLM's path: not under /v1
        http_tokenize = pool.submit(httpx.post, tokenize_url, json={"prompt": text}, timeout=120).result()
    burst_s = time.monotonic() - started
    reply = live.join(timeout_s=120)
    watching.set()
    watcher.join(timeout=10)
    assert reply.ok and len(reply.token_ids) == 200
    assert [(r.status_code, r.json()["error"]["message"]) for r in responses] == [(400, expected)] * 24
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert raised.value.details().startswith(f"text is {BIG_PROMPT_CHARS} bytes long")
    assert http_tokenize.status_code == 400
    assert http_tokenize.json()["error"]["message"].startswith(f"text is {BIG_PROMPT_CHARS} bytes long")
    after = rss_bytes(rank0)
    # The issue's bound. Kept refused bodies would be 24 x 4 MiB (~100 MB, a third of rank 0's ~300
    # MB); a refusal raised out of a worker thread's await kept its prompt in a cycle until the next
    # full garbage collection, +15% here (tpserve/server/http_api.py _on_worker).
    assert after <= before * 1.10, (before, after)
    assert daemon.health() == SERVING
    figures(
        "big prompts",
        refused=26,
        burst_s=round(burst_s, 2),
        largest_gap_s=round(largest_gap(token_counts), 3),
        rss_before=before,
        rss_after=after,
    )


# ---- malformed bytes ----

RAW_GOLDEN = sorted((Path(__file__).parent / "golden" / "errors" / "raw").glob("*.txt"))
_REPEAT = re.compile(rb"\{\{(\d+)\*(.*?)\}\}")


def read_raw_golden(path: Path) -> tuple[dict[str, str], bytes]:
    """The header and the body's bytes (tests/golden/errors/raw/README.md)."""
    header_text, _, body_text = path.read_text().partition("\n---\n")
    header = dict(line.split(": ", 1) for line in header_text.splitlines())
    body = codecs.escape_decode(body_text.rstrip("\n").encode())[0]
    return header, _REPEAT.sub(lambda match: match.group(2) * int(match.group(1)), body)


def send_raw_grpc(daemon, rpc: str, body: bytes) -> grpc.RpcError:
    identity = {"request_serializer": None, "response_deserializer": None}
    method = f"/tpserve.v1.Serving/{rpc}"
    with pytest.raises(grpc.RpcError) as raised:
        if rpc == "Generate":
            list(daemon.channel.unary_stream(method, **identity)(body, timeout=30))
        else:
            daemon.channel.unary_unary(method, **identity)(body, timeout=30)
    return raised.value


@pytest.mark.parametrize("path", RAW_GOLDEN, ids=lambda path: path.stem)
def test_malformed_bytes_get_their_golden_refusal_and_no_traceback(path, daemon):
    header, body = read_raw_golden(path)
    if header["api"] == "wire":
        status, reply = send_wire(daemon, body)
        assert status == int(header["status"])
        assert json.loads(reply)["error"]["message"] == header["message"]
    elif header["api"] == "http":
        response = post(daemon, header.get("path", "completions"), body)
        assert response.status_code == int(header["status"])
        error = response.json()["error"]
        assert error["message"] == header["message"]
        assert error["type"] == "invalid_request_error"
    else:
        error = send_raw_grpc(daemon, header.get("rpc", "Generate"), body)
        assert (error.code().name, error.details()) == (header["code"], header["message"])
    assert daemon.health() == SERVING
    assert tracebacks(daemon) == []


# ---- slow clients ----


def test_slow_loris_connections_are_closed_at_the_header_timeout_while_serving_goes_on(daemon):
    address = ("127.0.0.1", daemon.http_port)
    silent = [socket.create_connection(address, timeout=CLOSE_WITHIN_S) for _ in range(100)]
    dribbling = [socket.create_connection(address, timeout=CLOSE_WITHIN_S) for _ in range(100)]
    started = time.monotonic()
    for sock in dribbling:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n")
    live = BackgroundReply(
        daemon.stub, serving_pb2.GenerateRequest(prompt="go", max_tokens=30, ignore_eos=True)
    )
    with httpx.Client(timeout=60) as client:  # served beside them, before and after their deadline
        for _ in range(3):
            body = {"prompt": "hello", "max_tokens": 2}
            assert client.post(f"{daemon.http_url}/completions", json=body).status_code == 200
            for sock in dribbling:
                with contextlib.suppress(OSError):
                    sock.sendall(b"x")
            time.sleep(HEADER_TIMEOUT_S / 3)
    assert all(closed_by_server(sock) for sock in silent + dribbling)
    closed_after = time.monotonic() - started
    assert closed_after >= HEADER_TIMEOUT_S
    assert live.join().ok
    assert daemon.health() == SERVING and tracebacks(daemon) == []
    figures("slow loris", connections=200, all_closed_after_s=round(closed_after, 2))


def test_a_body_shorter_than_its_content_length_gets_408_at_the_body_timeout(daemon):
    sock = socket.create_connection(("127.0.0.1", daemon.http_port), timeout=CLOSE_WITHIN_S)
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b'content-length: 100\r\n\r\n{"prompt": '
    )
    reply = b""
    while b"}}" not in reply:
        chunk = sock.recv(65536)
        assert chunk, reply
        reply += chunk
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408 ")
    assert (
        json.loads(body)["error"]["message"] == f"the request body did not arrive within {BODY_TIMEOUT_S:g} s"
    )
    assert closed_by_server(sock)
    assert daemon.health() == SERVING


def test_a_kept_alive_connection_has_tcp_nodelay_on_the_daemons_end(daemon):
    """The issue's ~40 ms per kept-alive request was Nagle holding a reply's second write (uvicorn
    writes the head, then the body) until the client's delayed ACK. What prevents it is TCP_NODELAY
    on the daemon's end of the connection, read here from the daemon's own socket after a second
    request on it (tests/peer_socket.py). How long that request takes is bench/keep_alive.py's to
    measure, never a test's to gate on."""
    rank0 = [proc.pid for proc in (daemon.ranks()[0], daemon.front()) if proc is not None]
    connection = http.client.HTTPConnection("127.0.0.1", daemon.http_port, timeout=60)
    try:
        for _ in range(2):
            connection.request("GET", "/v1/models")
            assert connection.getresponse().read()
        client_port = connection.sock.getsockname()[1]
        with peer_socket(rank0, daemon.http_port, client_port) as daemons_end:
            assert daemons_end.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
    finally:
        connection.close()


# ---- overload ----

MAX_RUNNING = 4 + 64 + 16  # lanes + queue places + the extra workers (tpserve/server/grpc_server.py)


def test_past_the_grpc_pool_every_call_gets_the_queue_full_wording(daemon):
    """Health Watch calls hold a worker each for as long as they stay open: past the pool, every
    call (Watch, Generate, Tokenize) is refused in the lane host's queue-full words, none in grpc's
    own ("Concurrent RPC limit exceeded!"); once they close, serving goes on."""
    health = health_pb2_grpc.HealthStub(daemon.channel)
    watches = [health.Watch(health_pb2.HealthCheckRequest(), timeout=120) for _ in range(MAX_RUNNING + 20)]
    try:
        refused = []
        for watch in watches:
            try:
                assert next(watch).status == SERVING
            except grpc.RpcError as error:
                refused.append((error.code(), error.details()))
        full = (grpc.StatusCode.RESOURCE_EXHAUSTED, QUEUE_FULL)
        assert len(refused) >= 20 and set(refused) == {full}
        with pytest.raises(grpc.RpcError) as raised:
            list(daemon.stub.Generate(serving_pb2.GenerateRequest(prompt="hi", max_tokens=2), timeout=30))
        assert (raised.value.code(), raised.value.details()) == full
        with pytest.raises(grpc.RpcError) as raised:
            daemon.stub.Tokenize(serving_pb2.TokenizeRequest(text="hi"), timeout=30)
        assert (raised.value.code(), raised.value.details()) == full
    finally:
        for watch in watches:
            watch.cancel()
    wait_until(
        lambda: daemon.stub.Tokenize(serving_pb2.TokenizeRequest(text="hi"), timeout=30).num_tokens == 2,
        "the pool to free",
        30,
    )
    assert daemon.health() == SERVING and tracebacks(daemon) == []
    figures("grpc overload", watches=len(watches), refused=len(refused))


# ---- fuzzing both APIs (slow) ----
#
# What a client could send either API, every shape the servers read: each OpenAI route's JSON body
# (every field name the server knows, with any JSON value, or one of the shapes a field expects:
# messages, tools, structured outputs; nested up to past the recursion limit), the body as raw or
# mutated bytes under any content type, whole HTTP/1.1 requests as bytes (a head of any method,
# target and headers), and every gRPC request message built from its descriptor (every field, nested
# messages, maps), then sent whole, or with a byte changed, or as raw bytes.

JSON_LEAF = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=40),
)
JSON_VALUE = st.recursive(
    JSON_LEAF,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
HTTP_PATHS = ["v1/completions", "v1/chat/completions", "tokenize", "detokenize", "invocations"]
BODY_KEYS = sorted({*FIELDS, *CHAT_FIELDS, "tokens", "return_token_strs", "add_special_tokens", "no_such"})
CONTENT_TYPES = ["application/json"] * 8 + ["application/json; charset=latin-1", "text/plain", "", "x/\xff"]
PART = st.fixed_dictionaries(
    {"type": st.sampled_from(["text", "image_url", "video_url", "input_audio"]) | JSON_LEAF},
    optional={
        "text": JSON_VALUE,
        "image_url": JSON_VALUE | st.fixed_dictionaries({"url": st.text(max_size=40)}),
    },
)
MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "tool", "developer"]) | JSON_LEAF},
    optional={
        "content": st.text(max_size=40) | st.lists(PART, max_size=3) | JSON_VALUE,
        "tool_calls": JSON_VALUE,
        "tool_call_id": JSON_VALUE,
        "name": JSON_VALUE,
    },
)
TOOL = st.fixed_dictionaries(
    {"type": st.just("function") | JSON_LEAF},
    optional={
        "function": st.fixed_dictionaries(
            {"name": st.text(max_size=12) | JSON_LEAF}, optional={"parameters": JSON_VALUE}
        )
        | JSON_VALUE
    },
)
SHAPES = {  # a field's expected shape, so the fuzz gets past the first type check
    "messages": st.lists(MESSAGE, max_size=3),
    "tools": st.lists(TOOL, max_size=2),
    "tool_choice": st.sampled_from(["auto", "none", "required"]) | JSON_VALUE,
    "response_format": st.fixed_dictionaries(
        {"type": st.sampled_from(["text", "json_object", "json_schema"])},
        optional={"json_schema": st.fixed_dictionaries({"schema": JSON_VALUE})},
    ),
    "structured_outputs": st.dictionaries(
        st.sampled_from(["json", "regex", "choice", "grammar", "json_object"]), JSON_VALUE, max_size=2
    ),
    "guided_json": JSON_VALUE,
    "guided_regex": st.text(max_size=20),
    "guided_grammar": st.text(max_size=40),
    "guided_choice": st.lists(st.text(max_size=8), max_size=3),
    "logit_bias": st.dictionaries(st.integers(-5, 300).map(str) | st.text(max_size=4), JSON_LEAF, max_size=3),
    "stream_options": st.dictionaries(
        st.sampled_from(["include_usage", "continuous_usage_stats"]), JSON_LEAF
    ),
    "tokens": st.lists(st.integers(-5, 300) | JSON_LEAF, max_size=6),
    "n": st.integers(-1, 3) | JSON_LEAF,
    "stream": st.booleans(),
}


@st.composite
def openai_bodies(draw) -> dict:
    """Any fields, each with its expected shape or any JSON value; usually a prompt or chat beside them."""
    keys = draw(st.lists(st.sampled_from(BODY_KEYS), max_size=6, unique=True))
    body = {key: draw(SHAPES.get(key, JSON_VALUE) | JSON_VALUE) for key in keys}
    choice = draw(st.sampled_from(["prompt", "messages", "as drawn"]))
    if choice == "prompt":
        body["prompt"] = draw(st.text(max_size=60))
    elif choice == "messages":
        body["messages"] = draw(SHAPES["messages"])
    body["max_tokens"] = draw(st.integers(-2, 8) | JSON_LEAF)
    return body


def json_bytes(value) -> bytes:
    return json.dumps(value, allow_nan=True).encode("utf-8", "surrogatepass")


def clean_body(path: str, text: str) -> dict:
    """A well-formed body for `path`, so replies run between the rest."""
    if path == "detokenize":
        return {"tokens": [ord(character) % 256 + 3 for character in text]}
    if path == "v1/chat/completions":
        return {"messages": [{"role": "user", "content": text}], "max_tokens": 4}
    return {"prompt": text} | ({} if path == "tokenize" else {"max_tokens": 4})


@st.composite
def http_bodies(draw, path: str) -> bytes:
    kind = draw(st.sampled_from(["clean", "body", "body", "raw", "mutated", "deep"]))
    if kind == "clean":
        return json_bytes(clean_body(path, draw(st.text(max_size=60))))
    if kind == "raw":
        return draw(st.binary(max_size=300))
    if kind == "deep":  # one field nested from a little to past the recursion limit
        depth = draw(st.integers(1, 3000))
        opener, closer = draw(st.sampled_from([("[", "]"), ('{"a":', "}")]))
        key = draw(st.sampled_from(BODY_KEYS))
        return f'{{"prompt": "x", "max_tokens": 2, "{key}": {opener * depth}1{closer * depth}}}'.encode()
    body = json_bytes(draw(openai_bodies()))
    if kind == "mutated":  # a well-formed body with a few bytes changed or cut
        data = bytearray(body)
        for _ in range(draw(st.integers(1, 4))):
            if data:
                data[draw(st.integers(0, len(data) - 1))] = draw(st.integers(0, 255))
        body = bytes(data[: draw(st.integers(0, len(data)))])
    return body


HEADER_NAME = st.sampled_from(
    [b"host", b"content-type", b"content-length", b"transfer-encoding", b"authorization", b"connection"]
) | st.binary(min_size=1, max_size=12)
HEADER_VALUE = st.binary(max_size=24) | st.sampled_from(
    [b"application/json", b"chunked", b"0", b"999999999999999999999", b"-1", b"Bearer x", b"[::", b"a b"]
)


@st.composite
def wire_requests(draw) -> bytes:
    """A whole HTTP/1.1 request as bytes: a method, a target, headers and a body, each may be wrong."""
    method = draw(st.sampled_from([b"POST", b"GET", b"PUT", b"OPTIONS", b"HEAD"]) | st.binary(max_size=8))
    path = draw(st.sampled_from([*HTTP_PATHS, "health", "v1/models"]))
    target = f"/{path}".encode() + draw(st.just(b"") | st.binary(max_size=16))
    body = draw(http_bodies(path))
    headers = [(b"host", draw(st.just(b"127.0.0.1") | HEADER_VALUE))]
    headers += [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += draw(st.lists(st.tuples(HEADER_NAME, HEADER_VALUE), max_size=3))
    head = method + b" " + target + b" HTTP/1.1\r\n" + b"".join(k + b": " + v + b"\r\n" for k, v in headers)
    return head + b"connection: close\r\n\r\n" + body


def proto_values(field, depth: int) -> st.SearchStrategy:
    FD = field.__class__
    if field.type == FD.TYPE_MESSAGE:
        return proto_messages(GetMessageClass(field.message_type), depth + 1)
    if field.type == FD.TYPE_ENUM:
        return st.sampled_from([value.number for value in field.enum_type.values])
    if field.type == FD.TYPE_STRING:
        return st.text(max_size=40)
    if field.type == FD.TYPE_BYTES:
        return st.binary(max_size=64)
    if field.type == FD.TYPE_BOOL:
        return st.booleans()
    if field.type in (FD.TYPE_FLOAT, FD.TYPE_DOUBLE):
        return st.floats(width=32 if field.type == FD.TYPE_FLOAT else 64)
    if field.type in (FD.TYPE_UINT32, FD.TYPE_UINT64, FD.TYPE_FIXED32, FD.TYPE_FIXED64):
        return st.integers(0, 2 ** (32 if field.type in (FD.TYPE_UINT32, FD.TYPE_FIXED32) else 64) - 1)
    bits = 64 if field.type in (FD.TYPE_INT64, FD.TYPE_SINT64, FD.TYPE_SFIXED64) else 32
    return st.integers(-5, 300) | st.integers(-(2 ** (bits - 1)), 2 ** (bits - 1) - 1)


@st.composite
def proto_messages(draw, message_class, depth: int = 0):
    """Any message of `message_class`: a few of its fields set, each to any value of its type."""
    message = message_class()
    if depth > 2:
        return message
    fields = message_class.DESCRIPTOR.fields
    for field in draw(st.lists(st.sampled_from(list(fields)), max_size=5, unique=True)) if fields else []:
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            key_field, value_field = field.message_type.fields
            entries = draw(
                st.dictionaries(proto_values(key_field, depth), proto_values(value_field, depth), max_size=3)
            )
            getattr(message, field.name).update(entries)
        elif field.is_repeated:
            getattr(message, field.name).extend(draw(st.lists(proto_values(field, depth), max_size=3)))
        elif field.message_type is not None:
            getattr(message, field.name).CopyFrom(draw(proto_values(field, depth)))
        else:
            setattr(message, field.name, draw(proto_values(field, depth)))
    return message


GRPC_MESSAGES = {
    "Generate": serving_pb2.GenerateRequest,
    "Tokenize": serving_pb2.TokenizeRequest,
    "Info": serving_pb2.InfoRequest,
}


@st.composite
def grpc_requests(draw) -> tuple[str, bytes]:
    rpc = draw(st.sampled_from(sorted(GRPC_MESSAGES)))
    if draw(st.integers(0, 3)) == 0:
        return rpc, draw(st.binary(max_size=200))
    message = draw(proto_messages(GRPC_MESSAGES[rpc]))
    if rpc == "Generate" and draw(st.integers(0, 4)):  # mostly a short reply, so the run keeps moving
        message.max_tokens = draw(st.integers(-2, 8))
    data = bytearray(message.SerializeToString())
    if data and draw(st.booleans()):
        data[draw(st.integers(0, len(data) - 1))] = draw(st.integers(0, 255))
    return rpc, bytes(data)


@st.composite
def hostile_requests(draw) -> tuple[str, str, bytes, str]:
    """(api, route or rpc, bytes, content type)."""
    api = draw(st.sampled_from(["http", "http", "http", "wire", "grpc", "grpc"]))
    if api == "grpc":
        rpc, data = draw(grpc_requests())
        return api, rpc, data, ""
    if api == "wire":
        return api, "", draw(wire_requests()), ""
    path = draw(st.sampled_from(HTTP_PATHS))
    return api, path, draw(http_bodies(path)), draw(st.sampled_from(CONTENT_TYPES))


HTTP_STATUSES = {200, 400, 401, 404, 405, 408, 413, 429}
GRPC_CODES = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION}


def check_http_reply(status: int, body: bytes, what) -> None:
    """No 500, and every refusal an OpenAI error object with a message."""
    assert status in HTTP_STATUSES, (status, body[:300], what)
    if status != 200 and body:
        assert json.loads(body)["error"]["message"], (status, body[:300], what)


def send_wire(daemon, raw: bytes) -> tuple[int, bytes] | None:
    """The raw request over its own connection; (status, body) of the reply, or None when the server
    closed the connection without one (a request it never got whole)."""
    with socket.create_connection(("127.0.0.1", daemon.http_port), timeout=60) as sock:
        sock.sendall(raw)
        reply = b""
        with contextlib.suppress(ConnectionResetError):
            while chunk := sock.recv(65536):
                reply += chunk
    if not reply:
        return None
    head, _, body = reply.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    if b"transfer-encoding: chunked" in head.lower():
        return status, b""  # a stream's events: their statuses are the HTTP fuzz's to check
    return status, body if b"content-type: application/json" in head.lower() else b"{}"


def send_hostile(daemon, request, statuses: Counter) -> None:
    api, target, data, content_type = request
    if api == "grpc":
        method = f"/tpserve.v1.Serving/{target}"
        try:
            if target == "Generate":
                list(daemon.channel.unary_stream(method)(data, timeout=60))
            else:
                daemon.channel.unary_unary(method)(data, timeout=60)
            statuses[f"grpc {target} OK"] += 1
        except grpc.RpcError as error:
            statuses[f"grpc {target} {error.code().name}"] += 1
            assert error.code() in GRPC_CODES, (error.code(), error.details(), data)
        return
    if api == "wire":
        reply = send_wire(daemon, data)
        statuses["wire closed" if reply is None else f"wire {reply[0]}"] += 1
        if reply is not None:
            check_http_reply(*reply, data[:300])
        return
    headers = {"content-type": content_type.encode("latin-1")} if content_type else {}
    response = httpx.post(
        f"{daemon.http_url.removesuffix('/v1')}/{target}", content=data, headers=headers, timeout=60
    )
    statuses[f"http {response.status_code}"] += 1
    check_http_reply(response.status_code, response.content, (target, data[:300]))


FUZZ_EXAMPLES = 1500  # about three minutes on an idle two-core machine


@pytest.mark.slow
def test_fuzzed_http_and_grpc_bytes_get_no_500_and_no_traceback(daemon):
    statuses = Counter()
    probe = serving_pb2.GenerateRequest(prompt="probe", max_tokens=2, ignore_eos=True)

    @settings(
        max_examples=FUZZ_EXAMPLES, deadline=None, database=None, suppress_health_check=list(HealthCheck)
    )
    @given(request=hostile_requests())
    def check(request):
        if sum(statuses.values()) % 50 == 0:  # the pair serving throughout
            assert len(list(daemon.stub.Generate(probe, timeout=60))) >= 2
        send_hostile(daemon, request, statuses)

    started = time.monotonic()
    check()
    assert daemon.health() == SERVING
    assert tracebacks(daemon) == []
    figures("fuzz both APIs", statuses=dict(statuses), seconds=round(time.monotonic() - started, 1))
