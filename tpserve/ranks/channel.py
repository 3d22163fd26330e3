"""The channel from rank 0 to the followers: messages in order, votes, the idle doorbell, the heartbeat.

Rank 0 broadcasts each message's head (and overflow) on a gloo group; followers receive them in
sequence. Before rank 0 goes idle it sends Idle, and from then on no rank sits in a collective: a
follower waits on its wake queue in the store (a blocking pop, no spinning) until rank 0 rings the
doorbell just ahead of its next message. A collective with a timeout would trip on a long idle
spell, and a store wait has no such limit, so while rank 0 is idle its heartbeat thread (started by
the first Idle, ended by Stop or close) pushes a beat into each follower's queue every heartbeat_s;
a follower that hears nothing for `leader_dead_after_s` (rank 0 dead or hung, while the store lives
on in torchrun's agent) or loses the store raises LeaderLost. That beat is a Python thread's, which a
call holding rank 0's GIL starves; so a follower told to `trust_leader_link` (the liveness link,
beaten natively: tpserve/ranks/liveness.py) waits on while that link says rank 0 lives.

Messages and votes are the same collective, an all-reduce (SUM) of HEAD_SIZE int64s: a message is
rank 0's head with the followers adding zeros, a vote is every rank's [VOTE_MAGIC, seq, ok]. Between
ranks on one host that sum goes through a shared-memory segment of the channel's own (`exchange`,
tpserve/kernels/shared_memory.py) rather than gloo's loopback TCP: a message then reaches a waiting
follower in microseconds, not the 0.5-1 ms of a gloo all-reduce and its thread wake-ups. So a
rank that votes while another receives (a vote skipped on either side, a message applied twice)
does not wait out the timeout in a mismatched collective: both read a sum that is neither a message
nor a full vote, and fail at once, naming the vote and the message.

Every failure latches: a failed or timed-out collective, a malformed or out-of-order message, a
lost leader, a vote that met a message. The channel then raises ChannelBroken on every later call, since the ranks can no
longer be sure they hold the same state. Calls on one rank come from one thread.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

from tpserve.kernels.shared_memory import SharedMemoryCollectives
from tpserve.ranks.wire import HEAD_SIZE, WireError, decode, encode, read_head
from tpserve.ranks.wire_messages import Idle, Message, Stop

__all__ = ["Channel", "ChannelBroken", "LeaderLost", "gist_of"]

log = logging.getLogger(__name__)

_BEAT = b"beat"
# "vote": the first of a vote's ints on every rank; small enough that a sum over ranks never wraps.
VOTE_MAGIC = 0x766F7465 << 16
# A dead follower never pops its queue; rank 0 stops adding beats once this many wait there.
_MAX_QUEUED_BEATS = 2


class ChannelBroken(RuntimeError):
    """A collective failed or timed out, or the ranks fell out of step: nothing more can run."""


class LeaderLost(ChannelBroken):
    """An idle follower heard nothing from rank 0 (no heartbeat, no doorbell) or lost the store."""


class Channel:
    """One per rank, built by every rank of `group` at the same point (construction is a collective).

    `group` is a gloo process group (None: the default group); the wire is small CPU tensors, so a
    NCCL deployment gives the channel its own `new_group(backend="gloo")`. `store` is the group's
    store; the channel works on its own clone so its waits never hold up anyone else's. `timeout_s`
    bounds every collective, `heartbeat_s` is rank 0's beat interval while idle. `exchange`: a
    shared-memory segment of the channel's own between ranks on one host, which then carries the
    messages and votes in gloo's place (built with the same timeout).
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        store: dist.Store,
        *,
        rank: int,
        timeout_s: float,
        heartbeat_s: float = 2.0,
        leader_dead_after_s: float = 30.0,
        exchange: SharedMemoryCollectives | None = None,
    ):
        if dist.get_backend(group) != "gloo":
            raise ValueError(f"the channel needs a gloo group, got {dist.get_backend(group)}")
        if rank != dist.get_rank(group):
            raise ValueError(
                f"rank {rank} given, but this process is rank {dist.get_rank(group)} of the group"
            )
        if not 0 < heartbeat_s * 2 <= leader_dead_after_s:
            raise ValueError(
                f"leader_dead_after_s ({leader_dead_after_s}) must be at least twice heartbeat_s ({heartbeat_s})"
            )
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        self.rank = rank
        self.world_size = dist.get_world_size(group)
        self.timeout_s = timeout_s
        self.heartbeat_s = heartbeat_s
        self.leader_dead_after_s = leader_dead_after_s
        self._group = group
        self._exchange = exchange
        self._next_seq = 0  # rank 0: the next to send; followers: the next expected
        self._idle_seq: int | None = None  # the Idle message that ended the last exchange, if it did
        self._broken: str | None = None
        self._idle_lock = threading.Lock()  # rank 0: ringing vs. the heartbeat thread's beats
        self._heartbeat: threading.Thread | None = None
        self._stop_heartbeat = threading.Event()
        # Rank 0: set by the heartbeat thread when an idle follower stops answering.
        self.lost_follower: str | None = None
        self._leader_alive: Callable[[], bool] | None = None
        self._store = self._own_store(store)

    # --- rank 0 -------------------------------------------------------------------------------

    def send(self, msg: Message) -> None:
        """Broadcast `msg` to the followers, first waking them if the last message was Idle."""
        self._require(self.rank == 0, "send", "rank 0")
        seq = self._next_seq
        with self._idle_lock:
            if self._idle_seq is not None:
                self._push_to_followers(f"ring:{self._idle_seq}".encode(), f"ring the doorbell for #{seq}")
                self._idle_seq = None
        tensor = encode(msg, seq)  # shape [HEAD_SIZE + overflow]
        what = f"send {type(msg).__name__} #{seq}"
        self._broadcast(tensor[:HEAD_SIZE], what)
        if tensor.numel() > HEAD_SIZE:
            self._broadcast(tensor[HEAD_SIZE:], f"{what} (overflow)")
        self._next_seq += 1
        if isinstance(msg, Idle):
            with self._idle_lock:
                self._idle_seq = seq
            self._start_heartbeat()
        elif isinstance(msg, Stop):
            self.close()

    def close(self) -> None:
        """Rank 0: stop the heartbeat thread (sending Stop does it too). Idempotent."""
        if self._heartbeat is None:
            return
        self._stop_heartbeat.set()
        self._heartbeat.join(timeout=self.heartbeat_s + self.leader_dead_after_s)
        self._heartbeat = None

    # --- every rank ---------------------------------------------------------------------------

    def vote(self, ok: bool) -> bool:
        """True only when every rank is ok. Every rank calls it, after the same message."""
        self._require(True, "vote", "every rank")
        after = self._next_seq - 1
        ballot = torch.zeros(HEAD_SIZE, dtype=torch.int64)
        ballot[:3] = torch.tensor([VOTE_MAGIC, after, 1 if ok else 0])
        what = f"vote after #{after}"
        self._sum(ballot, what, "the other ranks")
        magic, seq, num_ok = ballot[:3].tolist()
        if magic != self.world_size * VOTE_MAGIC or seq != self.world_size * after:
            expected = "rank 0 sent a message" if self.rank else "a follower waited for a message"
            raise self._break(
                ChannelBroken,
                f"rank {self.rank}: {what}: {expected} instead of voting after #{after} "
                "(a vote skipped, or a message applied twice)",
            )
        return num_ok == self.world_size

    # --- followers ----------------------------------------------------------------------------

    def receive(self) -> Message:
        """The next message from rank 0. Blocks in the broadcast while rank 0 is busy (up to
        timeout_s), and after an Idle first waits on the doorbell (no collective, no timeout
        while rank 0's heartbeat goes on)."""
        self._require(self.rank != 0, "receive", "a follower")
        if self._idle_seq is not None:
            self._wait_for_doorbell(self._idle_seq)
            self._idle_seq = None
        seq = self._next_seq
        head = torch.zeros(HEAD_SIZE, dtype=torch.int64)
        self._broadcast(head, f"receive #{seq}")
        first = head[0].item()
        if first and first % VOTE_MAGIC == 0:
            raise self._break(
                ChannelBroken,
                f"rank {self.rank}: receive #{seq}: rank 0 voted after #{seq - 1} where this rank "
                "waited for the next message (a vote skipped here, or a message applied twice)",
            )
        try:
            info = read_head(head)
            if info.seq != seq:
                raise WireError(f"message #{info.seq} arrived where #{seq} was due")
            tensor = head
            if info.overflow_size:
                overflow = torch.zeros(info.overflow_size, dtype=torch.int64)
                self._broadcast(overflow, f"receive #{seq} (overflow)")
                tensor = torch.cat([head, overflow])
            msg = decode(tensor)
        except WireError as err:
            raise self._break(ChannelBroken, f"rank {self.rank}: receive #{seq} from rank 0: {err}") from err
        self._next_seq += 1
        if isinstance(msg, Idle):
            self._idle_seq = seq
        return msg

    def trust_leader_link(self, alive: Callable[[], bool]) -> None:
        """A follower: while idle, a late heartbeat is no loss as long as alive() (rank 0's liveness
        link, which learns a lost rank 0 itself) says rank 0 still beats."""
        self._require(self.rank != 0, "trust_leader_link", "a follower")
        self._leader_alive = alive

    # --- inside -------------------------------------------------------------------------------

    def _own_store(self, store: dist.Store) -> dist.Store:
        """A clone of `store` under a prefix fresh to this channel, agreed on by a broadcast."""
        own = store.clone()
        generation = torch.zeros(1, dtype=torch.int64)
        if self.rank == 0:
            generation[0] = own.add("tpserve/wire/generation", 1)
        self._broadcast(generation, "agree on the channel's store prefix")
        own = dist.PrefixStore(f"tpserve/wire/{generation.item()}", own)
        # A follower's blocking pop waits this long for a beat or the doorbell.
        own.set_timeout(timedelta(seconds=self.leader_dead_after_s))
        return own

    def _start_heartbeat(self) -> None:
        """Beat into each follower's wake queue every heartbeat_s while idle (from the first Idle on)."""
        if self._heartbeat is not None:
            return
        self._stop_heartbeat.clear()
        # One store client per thread: the beat gets its own.
        self._heartbeat = threading.Thread(
            target=self._beat, args=(self._store.clone(),), name="wire-heartbeat", daemon=True
        )
        self._heartbeat.start()

    def _wait_for_doorbell(self, idle_seq: int) -> None:
        ring = f"ring:{idle_seq}".encode()
        while True:
            try:
                value = self._store.queue_pop(self._wake_key(self.rank), block=True)
            except dist.DistNetworkError as err:
                raise self._break(
                    LeaderLost,
                    f"rank {self.rank}: lost the store while idle after #{idle_seq} "
                    f"(rank 0 or the launcher that serves it is gone): {gist_of(err)}",
                ) from err
            except dist.DistError as err:
                if self._leader_alive is not None and self._leader_alive():
                    log.warning(
                        "rank %d: no idle heartbeat from rank 0 within %gs, but its liveness link "
                        "beats (its interpreter is busy): waiting on",
                        self.rank,
                        self.leader_dead_after_s,
                    )
                    continue
                raise self._break(
                    LeaderLost,
                    f"rank {self.rank}: no heartbeat nor doorbell from rank 0 within "
                    f"{self.leader_dead_after_s:g}s while idle after #{idle_seq}: {gist_of(err)}",
                ) from err
            if value == ring:
                return
            if value != _BEAT:
                raise self._break(
                    ChannelBroken, f"rank {self.rank}: woke to {value!r} while waiting for {ring!r}"
                )

    def _beat(self, store: dist.Store) -> None:
        failing = False
        backlog_since: dict[int, float] = {}  # follower -> when its beats started piling up
        while not self._stop_heartbeat.wait(self.heartbeat_s):
            with self._idle_lock:
                if self._idle_seq is None:
                    backlog_since.clear()
                    continue
                try:
                    for follower in range(1, self.world_size):
                        if store.queue_len(self._wake_key(follower)) < _MAX_QUEUED_BEATS:
                            store.queue_push(self._wake_key(follower), _BEAT)
                            backlog_since.pop(follower, None)
                            continue
                        # An idle follower pops every beat at once; one that lets them pile up for
                        # leader_dead_after_s is dead or hung, and rank 0 learns it while idle.
                        since = backlog_since.setdefault(follower, time.monotonic())
                        if time.monotonic() - since > self.leader_dead_after_s and self.lost_follower is None:
                            self.lost_follower = (
                                f"rank {follower} took no heartbeat for {self.leader_dead_after_s:g}s while idle"
                                " (dead or hung)"
                            )
                            log.error("rank 0: %s", self.lost_follower)
                except dist.DistError as err:
                    if not failing:
                        log.warning("heartbeat: cannot reach the store: %s", gist_of(err))
                    failing = True
                    continue
            if failing:
                log.info("heartbeat: the store answers again")
                failing = False

    def _push_to_followers(self, value: bytes, what: str) -> None:
        try:
            for follower in range(1, self.world_size):
                self._store.queue_push(self._wake_key(follower), value)
        except dist.DistError as err:
            raise self._break(ChannelBroken, f"rank 0: {what}: the store failed: {gist_of(err)}") from err

    def _broadcast(self, tensor: torch.Tensor, what: str) -> None:
        """Rank 0's tensor to every rank, as a sum in which the followers add zeros (see the module
        docstring); rank 0 checks that nothing was added."""
        peers = "the followers" if self.rank == 0 else "rank 0"
        sent = tensor.clone() if self.rank == 0 else None
        self._sum(tensor, what, peers)
        if sent is not None and not torch.equal(tensor, sent):
            voted = tensor.numel() >= 3 and (tensor - sent)[0].item() == VOTE_MAGIC
            raise self._break(
                ChannelBroken,
                f"rank 0: {what}: "
                + (
                    "a follower voted instead of receiving it (a vote skipped on rank 0, or a message "
                    "applied twice)"
                    if voted
                    else "a follower sent data instead of receiving it"
                ),
            )

    def _sum(self, tensor: torch.Tensor, what: str, peers: str) -> None:
        """`tensor` becomes its sum over the ranks, in place, within timeout_s (through the exchange
        where there is one, else gloo); any failure breaks the channel, naming who failed to answer."""
        started = time.monotonic()
        try:
            if self._exchange is not None:
                self._exchange.all_reduce_sum(tensor)  # PeerLost, a RuntimeError, when one is not
            else:
                work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self._group, async_op=True)
                work.wait(timeout=timedelta(seconds=self.timeout_s))
        except RuntimeError as err:
            raise self._break(
                ChannelBroken,
                f"rank {self.rank}: {what}: {peers} did not answer "
                f"({time.monotonic() - started:.1f}s, timeout {self.timeout_s:g}s): {gist_of(err)}",
            ) from err

    def _break(self, kind: type[ChannelBroken], message: str) -> ChannelBroken:
        self._broken = message
        return kind(message)

    def _require(self, allowed: bool, call: str, owner: str) -> None:
        if not allowed:
            raise RuntimeError(f"rank {self.rank} called {call}, which only {owner} may call")
        if self._broken is not None:
            raise ChannelBroken(f"rank {self.rank}: {call}: the channel broke earlier: {self._broken}")

    @staticmethod
    def _wake_key(follower: int) -> str:
        return f"wake/{follower}"


def gist_of(err: BaseException) -> str:
    """The gist of a gloo or store error: its first lines, without source paths or sign-offs."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip() and "GLHF" not in line]
    text = " ".join(lines[:2]) if lines else type(err).__name__
    return re.sub(r"\[[^\]]*\.(cc|cpp|h):\d+\]\s*", "", text)
