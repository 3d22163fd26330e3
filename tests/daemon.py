"""The real daemon as subprocesses, for tests: start it, wait until it serves, find its ranks, end it.

Three layouts, the ways users start it (two ranks, gloo, loopback):
- "spawn":  one `tpserve serve`; rank 0 starts the follower as its own child process.
- "ranks":  one `tpserve serve --rank R --master 127.0.0.1:PORT` per rank (the two-host way).
- "launch": `launch.sh`, that is torchrun with both ranks as its workers.

`running_daemon` always kills every process it started and everything those started (tracked by
pid and start time, so a reused pid is never touched), also when the test fails; a failing test
gets the daemon's log in its report.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from safetensors.torch import save_file
from tiny_models import BASE, CHAT_TEMPLATE, VARIANTS, build_tokenizer, random_weights

from tpserve.ranks.local_ranks import free_port
from tpserve.v1 import serving_pb2_grpc

REPO = Path(__file__).resolve().parent.parent
AS_FROM_A_SHELL = Path(__file__).resolve().parent / "as_from_a_shell.py"
# 3 specials + 256 bytes: the vocabulary the golden error files name ("... of 259 tokens").
DAEMON_VOCAB_SIZE = 259
START_TIMEOUT_S = 120.0  # two torch processes starting on a busy two-core machine
EXIT_TIMEOUT_S = 30.0
POLL_S = 0.05
FRONT_MODULE = "tpserve.server.front_process"


def one_lane_args(context: int) -> tuple[str, ...]:
    """One lane and one queue place, with `context` tokens of room: a daemon for cancels, deadlines,
    hang-ups and a full queue."""
    return ("--context", str(context), "--lanes", "1", "--queue-size", "1")


SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class DaemonFailed(AssertionError):
    """The daemon did not start, or did not end, as a test expected."""


def write_daemon_model(out_dir: str | Path) -> Path:
    """A tiny random Llama (uneven 2+1 KV split, tied embeddings) with the byte-level 259-token
    vocabulary, so the golden files' numbers hold against the real daemon too."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(DAEMON_VOCAB_SIZE)
    config = {**BASE, **VARIANTS["llama"], "vocab_size": tokenizer.get_vocab_size()}
    (out / "config.json").write_text(json.dumps(config, indent=1))
    tokenizer.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": CHAT_TEMPLATE, "eos_token": "<|endoftext|>", "add_bos_token": False})
    )
    save_file(random_weights(config, seed=0), str(out / "model.safetensors"))
    return out


# ---- processes, by pid and start time ----


@dataclass(frozen=True)
class Proc:
    pid: int
    start_ticks: int  # /proc/PID/stat field 22: tells this process from a later one with its pid


def _stat(pid: int) -> list[str] | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # The command name (field 2) may hold spaces; everything after its closing parenthesis is plain.
    return text[text.rindex(")") + 2 :].split()  # [state, ppid, ...]; start time is index 19


def proc_of(pid: int) -> Proc | None:
    fields = _stat(pid)
    return None if fields is None else Proc(pid, int(fields[19]))


def is_alive(proc: Proc) -> bool:
    """Running and not a zombie (a killed grandchild may wait unreaped; it holds nothing)."""
    fields = _stat(proc.pid)
    return fields is not None and int(fields[19]) == proc.start_ticks and fields[0] not in ("Z", "X")


def children_of(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            fields = _stat(int(entry.name))
            if fields is not None and int(fields[1]) == pid:
                found.append(int(entry.name))
    return found


def descendants_of(pid: int) -> list[int]:
    found, frontier = [], [pid]
    while frontier:
        children = [child for parent in frontier for child in children_of(parent)]
        found += children
        frontier = children
    return found


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return ""


def environ_rank(pid: int) -> int | None:
    try:
        entries = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    for entry in entries:
        if entry.startswith(b"RANK="):
            return int(entry[5:])
    return None


def wait_until(condition, what: str, timeout_s: float, poll_s: float = POLL_S) -> float:
    """Polls until condition() is true; returns the seconds it took, or fails naming `what`."""
    started = time.monotonic()
    while not condition():
        if time.monotonic() - started > timeout_s:
            raise DaemonFailed(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(poll_s)
    return time.monotonic() - started


# ---- the daemon ----


@dataclass
class Daemon:
    layout: str
    port: int
    metrics_port: int
    http_port: int
    log_dir: Path
    launched: dict[str, subprocess.Popen] = field(default_factory=dict)  # log name -> process
    known: set[Proc] = field(default_factory=set)  # everything seen in the daemon's process trees
    ca_pem: bytes | None = None  # the CA that signed the daemon's certificate, when it serves TLS
    _channel: grpc.Channel | None = None

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def http_url(self) -> str:
        """The OpenAI-compatible API's base URL (what the openai client takes as base_url)."""
        return f"{'http' if self.ca_pem is None else 'https'}://127.0.0.1:{self.http_port}/v1"

    @property
    def channel(self) -> grpc.Channel:
        if self._channel is None and self.ca_pem is None:
            self._channel = grpc.insecure_channel(self.target)
        elif self._channel is None:
            credentials = grpc.ssl_channel_credentials(root_certificates=self.ca_pem)
            self._channel = grpc.secure_channel(self.target, credentials)
        return self._channel

    @property
    def stub(self) -> serving_pb2_grpc.ServingStub:
        return serving_pb2_grpc.ServingStub(self.channel)

    def health(self, service: str = "", timeout_s: float = 5.0) -> int:
        stub = health_pb2_grpc.HealthStub(self.channel)
        return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s).status

    def metrics(self) -> dict[str, float]:
        """The Prometheus page as {series: value}, e.g. values['tpserve_lanes_busy']."""
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=5.0) as page:
            text = page.read().decode()
        return {
            line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line and not line.startswith("#")
        }

    def wait_idle(self, timeout_s: float = 10.0) -> float:
        """Waits for no busy lane, no used room and an empty queue (read from the metrics page)."""

        def idle() -> bool:
            values = self.metrics()
            return (
                values["tpserve_lanes_busy"] == 0
                and values["tpserve_room_used_tokens"] == 0
                and values["tpserve_queue_depth"] == 0
            )

        return wait_until(idle, "every lane and all room to be free", timeout_s)

    def wait_count(self, series: str, reaches: float, timeout_s: float = 10.0) -> dict[str, float]:
        """Waits for a counter to reach `reaches` and returns the metrics then.

        A reply's outcome is counted by the thread that relayed it, a moment after its lane went
        back, so a test that saw the lane free still waits for the count."""
        wait_until(
            lambda: self.metrics().get(series, 0) >= reaches, f"{series} to reach {reaches:g}", timeout_s
        )
        return self.metrics()

    # -- processes --

    def track(self) -> None:
        """Remember every process now in the daemon's trees, so none can slip away unnoticed."""
        for process in self.launched.values():
            for pid in [process.pid, *descendants_of(process.pid)]:
                proc = proc_of(pid)
                if proc is not None:
                    self.known.add(proc)

    def ranks(self) -> dict[int, Proc]:
        """rank -> its process, found in the daemon's trees (a layout's own way)."""
        self.track()
        if self.layout == "ranks":
            found = {int(name.removeprefix("rank")): proc_of(p.pid) for name, p in self.launched.items()}
        elif self.layout == "spawn":
            rank0 = self.launched["daemon"]
            followers = [pid for pid in descendants_of(rank0.pid) if "spawn_main" in cmdline(pid)]
            found = {0: proc_of(rank0.pid)} | {i + 1: proc_of(pid) for i, pid in enumerate(sorted(followers))}
        else:
            launcher = self.launched["launch"]
            workers = [pid for pid in descendants_of(launcher.pid) if "tpserve.cli" in cmdline(pid)]
            found = {environ_rank(pid): proc_of(pid) for pid in workers}
        return {rank: proc for rank, proc in found.items() if rank is not None and proc is not None}

    def front(self) -> Proc | None:
        """Rank 0's front process (the APIs, tpserve/server/front_process.py), or None when it runs none."""
        self.track()
        fronts = [
            proc
            for process in self.launched.values()
            for pid in descendants_of(process.pid)
            if FRONT_MODULE in cmdline(pid) and (proc := proc_of(pid)) is not None
        ]
        return fronts[0] if fronts else None

    def signal(self, rank: int, signum: int) -> Proc:
        proc = self.ranks()[rank]
        os.kill(proc.pid, signum)
        return proc

    def signal_group(self, signum: int) -> None:
        """To the first launched process's whole group, as Ctrl-C in its terminal would."""
        os.killpg(next(iter(self.launched.values())).pid, signum)

    def signal_launcher(self, signum: int) -> None:
        """To launch.sh itself, as a supervisor stopping it would."""
        self.launched["launch"].send_signal(signum)

    def leftovers(self) -> list[str]:
        """The daemon's processes still running, described (empty once it has fully ended)."""
        self.track()
        return [f"{proc.pid} ({cmdline(proc.pid)[:120]})" for proc in self.known if is_alive(proc)]

    def wait_exits(self, names: list[str] | None = None, timeout_s: float = EXIT_TIMEOUT_S) -> dict[str, int]:
        """Waits for the launched processes (all, or those named) to exit; returns their exit codes."""
        chosen = {name: self.launched[name] for name in (names or list(self.launched))}
        deadline = time.monotonic() + timeout_s
        codes = {}
        for name, process in chosen.items():
            try:
                codes[name] = process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise DaemonFailed(f"{name} did not exit within {timeout_s:g} s") from None
        return codes

    def logs(self) -> str:
        return "\n".join(
            f"==== {path.name} ====\n{path.read_text(errors='replace')}"
            for path in sorted(self.log_dir.glob("*.log"))
        )

    def wait_serving(self, timeout_s: float = START_TIMEOUT_S) -> float:
        """Waits for health SERVING; fails at once if a launched process exits first."""
        started = time.monotonic()
        while True:
            for name, process in self.launched.items():
                if process.poll() is not None:
                    raise DaemonFailed(f"{name} exited with {process.returncode} before serving")
            try:
                if self.health(timeout_s=1.0) == SERVING:
                    self.track()
                    return time.monotonic() - started
            except grpc.RpcError:
                pass
            if time.monotonic() - started > timeout_s:
                raise DaemonFailed(f"the daemon did not serve within {timeout_s:g} s")
            time.sleep(0.2)

    def close(self) -> None:
        """Kills whatever is left of the daemon (SIGKILL), reaps it and closes the channel."""
        if self._channel is not None:
            self._channel.close()
            self._channel = None
        self.track()
        for proc in self.known:
            if is_alive(proc):
                with suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGKILL)
        for process in self.launched.values():
            with suppress(subprocess.TimeoutExpired):
                process.wait(timeout=10)


def daemon_env() -> dict[str, str]:
    env = dict(os.environ)
    # launch.sh runs `python3` when the repository has no .venv: make that this interpreter's.
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONUNBUFFERED"] = "1"
    env["OMP_NUM_THREADS"] = "1"
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)  # a torchrun environment here would place the daemon's ranks
    env.pop("TPSERVE_API_KEY", None)  # a key in the tester's shell would lock every test out
    return env


def serve_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "tpserve.cli", "serve", *args]


def refused_start(model_dir: str | Path, *args: str, env: dict[str, str] | None = None) -> str:
    """`tpserve serve` with flags it must refuse at start-up: asserts it exits 2; its output."""
    command = serve_command(
        "--model", str(model_dir), "--device", "cpu", "--port", "0", "--http-port", "0", *args
    )
    ended = subprocess.run(
        command,
        env={**daemon_env(), **(env or {})},
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=START_TIMEOUT_S,
    )
    output = ended.stdout + ended.stderr
    assert ended.returncode == 2, output
    return output


def serve_args(model_dir: str | Path, daemon: Daemon) -> list[str]:
    """The flags every test daemon is served with: its model, its ports, one thread per rank, the CPU."""
    return [
        "--model",
        str(model_dir),
        "--port",
        str(daemon.port),
        "--metrics-port",
        str(daemon.metrics_port),
        "--http-port",
        str(daemon.http_port),
        "--threads-per-rank",
        "1",
        "--device",  # the CPU, also on a GPU host; a test marked gpu names cuda after these
        "cpu",
    ]


def launch(
    layout: str,
    model_dir: str | Path,
    log_dir: str | Path,
    *args: str,
    ranks_to_start: tuple[int, ...] = (0, 1),
    env: dict[str, str] | None = None,
) -> Daemon:
    """Starts the daemon's processes (not waiting for them). `args` are further serve flags; `env`,
    variables to add to their environment."""
    log_dir = Path(log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    daemon = Daemon(layout, free_port(), free_port(), free_port(), log_dir)
    common = [*serve_args(model_dir, daemon), *args]
    if layout == "spawn":
        commands = {"daemon": serve_command(*common)}
    elif layout == "ranks":
        master = f"127.0.0.1:{free_port()}"
        commands = {
            f"rank{rank}": serve_command(*common, "--rank", str(rank), "--master", master)
            for rank in ranks_to_start
        }
    elif layout == "launch":
        commands = {"launch": [str(REPO / "launch.sh"), *common]}
    else:
        raise ValueError(f"unknown layout {layout!r} (spawn, ranks or launch)")
    for name, command in commands.items():
        with open(log_dir / f"{name}.log", "wb") as log:
            # Its own session: a signal to this test's process group never reaches it, and a
            # test can send one to the daemon's group (as Ctrl-C in its terminal would), which
            # starts with the signals a shell gives it (tests/as_from_a_shell.py).
            daemon.launched[name] = subprocess.Popen(
                [sys.executable, str(AS_FROM_A_SHELL), *command],
                cwd=REPO,
                env={**daemon_env(), **(env or {})},
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
    return daemon


@contextmanager
def running_daemon(
    layout: str,
    model_dir: str | Path,
    log_dir: str | Path,
    *args: str,
    ranks_to_start: tuple[int, ...] = (0, 1),
    wait: bool = True,
    env: dict[str, str] | None = None,
) -> Iterator[Daemon]:
    """A started daemon (serving, unless wait=False); every process of it is killed on exit."""
    with serving(
        launch(layout, model_dir, log_dir, *args, ranks_to_start=ranks_to_start, env=env), wait
    ) as daemon:
        yield daemon


@contextmanager
def serving(daemon, wait: bool = True):
    """`daemon` once it serves (unless wait=False); every process of it killed on exit, and its logs
    printed when the test fails (pytest shows a failing test's output: the daemon's side of the story)."""
    try:
        if wait:
            daemon.wait_serving()
        yield daemon
    except BaseException:
        print(daemon.logs()[-20000:])
        raise
    finally:
        daemon.close()


# ---- clients ----


@dataclass
class Reply:
    """What one Generate call got: its tokens and text, and how it ended (a finish reason or a status)."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    prefilled: bool = False  # the first message (prompt in the KV cache) arrived
    num_token_messages: int = 0
    finish_reason: int = 0  # serving_pb2.FinishReason; 0 when the call failed instead
    last: object = None  # the final GenerateResponse
    code: grpc.StatusCode | None = None  # set when the call failed
    details: str = ""
    ended_at: float = 0.0  # time.monotonic()
    first_at: float = 0.0  # time.monotonic() at its first message (0: none came)
    logprobs: list = field(default_factory=list)  # serving_pb2.TokenLogprob, when the request asked

    @property
    def ok(self) -> bool:
        return self.code is None


def read_reply(call, reply: Reply | None = None, on_response=None) -> Reply:
    """Reads a Generate call to its end into `reply` (which another thread may watch grow);
    `on_response(reply)` runs after each message (a test may cancel the call there)."""
    reply = reply if reply is not None else Reply()
    try:
        for response in call:
            reply.first_at = reply.first_at or time.monotonic()
            reply.prefilled = reply.prefilled or response.prefilled
            if response.token_ids:
                reply.num_token_messages += 1
            reply.token_ids += response.token_ids
            reply.text += response.text
            reply.logprobs += response.logprobs
            if response.finish_reason:
                reply.finish_reason, reply.last = response.finish_reason, response
            if on_response is not None:
                on_response(reply)
    except grpc.RpcError as error:
        reply.code, reply.details = error.code(), error.details()
    reply.ended_at = time.monotonic()
    return reply


class BackgroundReply:
    """One Generate call read on its own thread; the test can watch it, cancel it and join it."""

    def __init__(self, stub, request, timeout_s: float = 60.0):
        self.call = stub.Generate(request, timeout=timeout_s)
        self.reply = Reply()
        self._thread = threading.Thread(target=read_reply, args=(self.call, self.reply), daemon=True)
        self._thread.start()

    def wait_tokens(self, num_tokens: int, timeout_s: float = 30.0) -> None:
        wait_until(
            lambda: len(self.reply.token_ids) >= num_tokens or self.reply.ended_at,
            f"{num_tokens} tokens of a reply",
            timeout_s,
            poll_s=0.005,
        )

    def join(self, timeout_s: float = 30.0) -> Reply:
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise DaemonFailed(f"a reply did not end within {timeout_s:g} s")
        return self.reply


def solo_then_together(served, requests, timeout_s: float = 300.0) -> tuple[list[Reply], list[Reply]]:
    """Each request alone, one after another; then all of them at once."""

    def generate(one):
        return read_reply(served.stub.Generate(one, timeout=timeout_s))

    solo = [generate(one) for one in requests]
    with ThreadPoolExecutor(len(requests)) as pool:
        return solo, list(pool.map(generate, requests))
