"""Two "hosts" on one machine, for tests: rank 0 in this network namespace, rank 1 in one of its own,
joined by a link, so rank 1 reaches rank 0 only over that link.

The link is a pair of TAP devices joined by tests/link_emulator.py, a cable in user space (this
machine's kernel has no netem, so latency, loss and cuts are made there). Its two addresses form a
/30 from 10.213.77.0/24 and exist only on the two ends (the namespace has no other interface but its
own loopback, and no route anywhere else), so nothing sent over the link can leave the machine.
Names carry this process's id, so parallel runs do not collide; `two_hosts()` always removes the
namespace, ends the emulator (the TAP devices go with it), and kills whatever still runs in the
namespace, also when the test fails.

Each rank starts through launch.sh as a user starts it on a host of their own:
`launch.sh --rank R --master RANK0_ADDR:PORT --interface IF ...` (rank 1 under `ip netns exec`).
Needs root, /dev/net/tun and iproute2 (`ip`); `skip_reason()` says why a test cannot run.
"""

from __future__ import annotations

import fcntl
import ipaddress
import itertools
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

from daemon import REPO, Daemon, daemon_env, free_port, serve_args, serving

NETWORK = ipaddress.ip_network("10.213.77.0/24")
LOCK_PATH = Path("/tmp/tpserve-two-hosts.lock")  # serialises picking a /30 among parallel runs
_counter = itertools.count()


def skip_reason() -> str | None:
    if os.geteuid() != 0:
        return "needs root, to make network namespaces and veth pairs"
    if shutil.which("ip") is None:
        return "needs iproute2 (`ip` not found; apt-get install iproute2)"
    if not Path("/dev/net/tun").exists():
        return "needs /dev/net/tun, for the TAP devices of the link"
    return None


def sh(*command: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(command, capture_output=True, text=True, check=check, timeout=30)


@dataclass
class Link:
    namespace: str  # rank 1's "host"
    near: str  # the TAP device here, rank 0's interface
    far: str  # the TAP device in the namespace, rank 1's interface
    near_address: str
    far_address: str
    emulator: subprocess.Popen | None = None

    def in_namespace(self, *command: str) -> list[str]:
        return ["ip", "netns", "exec", self.namespace, *command]

    def cut(self) -> None:
        """As if the cable were cut: nothing gets across, and neither end hears of it."""
        self._command("cut")

    def shape(self, what: str, value: float) -> None:
        """`delay` in ms or `loss` in percent, each way; `clear()` undoes it."""
        self._command(f"{what} {value:g}")

    def clear(self) -> None:
        self._command("clear")

    def _command(self, command: str) -> None:
        assert self.emulator is not None and self.emulator.stdin and self.emulator.stdout
        self.emulator.stdin.write(command + "\n")
        self.emulator.stdin.flush()
        answer = self.emulator.stdout.readline().strip()
        if answer != f"ok {command}":
            raise RuntimeError(f"the link emulator answered {answer!r} to {command!r}")


def _addresses_in_use() -> set[str]:
    shown = sh("ip", "-4", "-o", "addr", "show").stdout.split()
    return {word.split("/")[0] for word in shown if "/" in word}


def _make(link: Link) -> None:
    link.emulator = subprocess.Popen(
        [sys.executable, str(Path(__file__).with_name("link_emulator.py")), link.near, link.far],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    if link.emulator.stdout.readline().strip() != "ready":
        raise RuntimeError("the link emulator did not start (see its stderr)")
    sh("ip", "netns", "add", link.namespace)
    sh("ip", "link", "set", link.far, "netns", link.namespace)
    sh("ip", "addr", "add", f"{link.near_address}/30", "dev", link.near)
    sh("ip", "link", "set", link.near, "up")
    sh(*link.in_namespace("ip", "addr", "add", f"{link.far_address}/30", "dev", link.far))
    sh(*link.in_namespace("ip", "link", "set", link.far, "up"))
    sh(*link.in_namespace("ip", "link", "set", "lo", "up"))


def _remove(link: Link) -> None:
    pids = sh("ip", "netns", "pids", link.namespace, check=False).stdout.split()
    for pid in pids:  # only what runs in our own namespace: this test's rank 1 and its children
        with suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)
    if link.emulator is not None:
        link.emulator.kill()  # its TAP devices end with it
        link.emulator.wait(timeout=10)
    sh("ip", "netns", "del", link.namespace, check=False)


@contextmanager
def two_hosts() -> Iterator[Link]:
    number = next(_counter)
    tag = f"{os.getpid()}n{number}"
    with open(LOCK_PATH, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        used = _addresses_in_use()
        subnets = list(NETWORK.subnets(new_prefix=30))
        start = (os.getpid() * 7 + number) % len(subnets)
        for subnet in subnets[start:] + subnets[:start]:
            near, far = (str(host) for host in subnet.hosts())
            if near not in used and far not in used:
                break
        else:
            raise RuntimeError(f"every /30 of {NETWORK} is in use on this machine")
        link = Link(f"tpserve-{tag}", f"tpa{tag}", f"tpb{tag}", near, far)
        try:
            _make(link)
        except BaseException:
            _remove(link)
            raise
    try:
        yield link
    finally:
        _remove(link)


@dataclass
class Pair(Daemon):
    """The daemon's two ranks over a link: `master` is rank 0's store, `args` every rank's flags."""

    master: str = ""
    args: tuple[str, ...] = ()


def launch_rank(
    daemon: Pair, link: Link, rank: int, name: str, args: tuple[str, ...], interface: str = ""
) -> None:
    """Starts one rank as its host's user would (launch.sh, not waiting); logged to NAME.log.
    `interface`: its end of the link unless named."""
    interface = interface or (link.near if rank == 0 else link.far)
    command = [str(REPO / "launch.sh"), *args, "--interface", interface, "--rank", str(rank)]
    if rank:
        command = link.in_namespace(*command)
    env = daemon_env()
    for variable in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        env.pop(variable, None)
    with open(daemon.log_dir / f"{name}.log", "wb") as log:
        daemon.launched[name] = subprocess.Popen(
            command,
            cwd=REPO,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def pair(
    link: Link, model_dir: str | Path, log_dir: str | Path, *args: str, ranks: tuple[int, ...] = (0, 1)
) -> Pair:
    """The pair over `link` (gloo forced: one machine would otherwise pick shared memory), not waited
    for. Layout "ranks": launch.sh execs the rank, so each launched process is its rank."""
    log_dir = Path(log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    daemon = Pair("ranks", free_port(), free_port(), free_port(), log_dir)
    daemon.master = f"{link.near_address}:{free_port(link.near_address)}"
    daemon.args = (
        *serve_args(model_dir, daemon),
        "--cpu-collectives",
        "gloo",
        "--master",
        daemon.master,
        *args,
    )
    for rank in ranks:
        launch_rank(daemon, link, rank, f"rank{rank}", daemon.args)
    return daemon


@contextmanager
def running_pair(
    link: Link, model_dir, log_dir, *args: str, ranks: tuple[int, ...] = (0, 1), wait: bool = True
) -> Iterator[Pair]:
    with serving(pair(link, model_dir, log_dir, *args, ranks=ranks), wait) as daemon:
        yield daemon
