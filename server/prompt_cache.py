"""The prompt cache: which kept KV states exist, who borrows them, and when each may be freed.

Rank 0 decides; the states live in every rank's KV memory, written and freed by KEEP / RESTORE / EVICT
messages on the wire. This class holds bookkeeping only and reaches storage through `free_state`.

An entry id moves pending (reserve) -> live (commit: findable) -> dead (removed while borrowed) -> freed.
Every id `reserve` returns gets exactly one `free_state(id)` call, when nothing can refer to it any more:
an eviction, an abort, a redundant commit, a removal of an unborrowed entry, or the release of a dead
entry's last borrow. It is never called for a borrowed or a pending entry. It runs after the books are
updated and outside the lock; an eviction's call comes before `reserve` returns, so its EVICT precedes
the new KEEP on the wire. If it raises, the wire is broken and the engine is torn down with it.

A restore may take the first tokens of a state (the KV of position i depends only on tokens 0..i), so a
lookup finds the live entry sharing the longest prefix with the prompt (see prefix_index).
"""

from __future__ import annotations

import threading
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tpserve.server.prefix_index import PrefixIndex, to_tokens

__all__ = ["Borrow", "CacheStats", "PromptCache"]


@dataclass(frozen=True)
class Borrow:
    """Restore the first `num_tokens` of entry `entry_id`; hold this until the restore has reported."""

    entry_id: int
    num_tokens: int
    borrow_id: int  # unique per lookup, so a second release of the same borrow is caught


@dataclass(frozen=True)
class CacheStats:
    """A consistent snapshot for metrics; the counters only grow."""

    hits: int
    misses: int
    hit_tokens: int
    evictions: int
    keeps: int
    keeps_refused: int
    restore_failures: int
    held_bytes: int
    budget_bytes: int
    num_entries: int  # live entries (findable)
    num_dead: int  # removed entries still borrowed: not findable, still charged, not yet freed
    num_pending: int  # reserved, not yet committed or aborted
    num_live_states: int  # states the ranks hold: entries + dead + pending = ids reserved - frees


@dataclass(eq=False)
class _Entry:
    entry_id: int
    num_tokens: int
    num_bytes: int
    num_borrows: int = 0


class PromptCache:
    """Entries of kept prompt states, charged at bytes_per_token each against budget_bytes.

    free_state(entry_id) frees a state on every rank (an EVICT on the wire). States shorter than
    min_tokens are neither kept nor restored; lookups match whole blocks of block_size tokens first.
    """

    def __init__(
        self,
        budget_bytes: int,
        bytes_per_token: int,
        *,
        free_state: Callable[[int], None],
        min_tokens: int = 16,
        block_size: int = 16,
    ) -> None:
        if budget_bytes < 0 or bytes_per_token < 1:
            raise ValueError(
                f"need budget_bytes >= 0 and bytes_per_token >= 1, got {budget_bytes}, {bytes_per_token}"
            )
        if not 1 <= block_size <= min_tokens:
            raise ValueError(f"need 1 <= block_size ({block_size}) <= min_tokens ({min_tokens})")
        self._budget_bytes = budget_bytes
        self._bytes_per_token = bytes_per_token
        self._free_state = free_state
        self._min_tokens = min_tokens
        self._lock = threading.Lock()  # the scheduling thread writes; metrics threads read
        self._entries: dict[int, _Entry] = {}  # every id not yet freed
        self._lru: OrderedDict[int, None] = OrderedDict()  # live ids, least recently used first
        self._pending: set[int] = set()
        self._dead: set[int] = set()
        self._index = PrefixIndex(block_size)  # the tokens of live entries, searched by prefix
        self._borrows: dict[int, int] = {}  # borrow_id -> entry_id
        self._held_bytes = 0
        self._next_entry_id = 0
        self._next_borrow_id = 0
        self._counts = dict.fromkeys(
            ("hits", "misses", "hit_tokens", "evictions", "keeps", "keeps_refused", "restore_failures"), 0
        )

    # -- lookups and borrows ------------------------------------------------------------------------

    def lookup(self, prompt_ids: Sequence[int]) -> Borrow | None:
        """Borrow the live entry sharing the longest prefix with the prompt, leaving >= 1 token to compute.

        A match under min_tokens is a miss. Ties go to the shorter entry, so compact ones stay warm.
        """
        tokens = to_tokens(prompt_ids)
        with self._lock:
            match = self._restorable_locked(tokens)
            if match is None:
                self._counts["misses"] += 1
                return None
            entry, num_tokens = self._entries[match[0]], match[1]
            entry.num_borrows += 1
            self._lru.move_to_end(entry.entry_id)
            self._next_borrow_id += 1
            self._borrows[self._next_borrow_id] = entry.entry_id
            self._counts["hits"] += 1
            self._counts["hit_tokens"] += num_tokens
            return Borrow(entry.entry_id, num_tokens, self._next_borrow_id)

    def cached_length(self, prompt_ids: Sequence[int]) -> int:
        """The prompt tokens a lookup would restore now (0 for a miss); counts nothing, borrows nothing.

        Only a forecast for the scheduler: the entry may be gone, or its restore may fail, by the time
        the real lookup runs.
        """
        tokens = to_tokens(prompt_ids)
        with self._lock:
            match = self._restorable_locked(tokens)
        return 0 if match is None else match[1]

    def release(self, borrow: Borrow) -> None:
        """The borrower lets go; a dead entry's last release frees it."""
        with self._lock:
            to_free = self._release_locked(borrow)
        self._free_all(to_free)

    def restore_failed(self, borrow: Borrow) -> None:
        """The restore from this borrow failed: remove the entry (dead while others borrow it), release."""
        with self._lock:
            self._check_borrow(borrow)
            self._counts["restore_failures"] += 1
            self._remove_locked(self._entries[borrow.entry_id])
            to_free = self._release_locked(borrow)
        self._free_all(to_free)

    # -- keeps --------------------------------------------------------------------------------------

    def keep_points(self, prompt_ids: Sequence[int], boundaries: Sequence[int] = ()) -> list[int]:
        """Prompt lengths worth keeping a state of, best first; keep only the first that `reserve` takes.

        Candidates are the end of the prompt and the caller's boundaries (from the chat template: the end
        of a system block, the start of the last user turn), which serve as smaller fallbacks when the
        whole prompt does not fit. A kept state serves every shorter prefix, so a point is only worth it
        when it reaches at least min_tokens beyond what a lookup could already restore from a live
        entry, and when its state can fit the budget at all.
        """
        tokens = to_tokens(prompt_ids)
        for boundary in boundaries:
            if not 0 <= boundary <= len(tokens):
                raise ValueError(f"keep boundary {boundary} is outside the prompt of {len(tokens)} tokens")
        with self._lock:
            match = self._index.longest_match(tokens, limit=len(tokens))
        covered = 0 if match is None or match[1] < self._min_tokens else match[1]
        most_tokens = self._budget_bytes // self._bytes_per_token
        points = {p for p in (*boundaries, len(tokens)) if p >= self._min_tokens}
        return sorted(
            (p for p in points if p - covered >= self._min_tokens and p <= most_tokens), reverse=True
        )

    def reserve(self, num_tokens: int) -> int | None:
        """Charge a new state of num_tokens and return its entry id, evicting unborrowed live entries LRU.

        All or nothing: when even evicting every unborrowed live entry would not make room (the rest is
        borrowed or pending, or the budget is too small), nothing is evicted or charged and it returns
        None; the caller then runs the request without keeping.
        """
        if num_tokens < self._min_tokens:
            raise ValueError(f"a kept state needs at least {self._min_tokens} tokens, got {num_tokens}")
        num_bytes = num_tokens * self._bytes_per_token
        with self._lock:
            victims = self._pick_victims(num_bytes)
            if victims is None:
                self._counts["keeps_refused"] += 1
                return None
            for entry in victims:
                self._unindex(entry)
                self._drop(entry)
            self._counts["evictions"] += len(victims)
            entry_id = self._next_entry_id
            self._next_entry_id += 1
            self._entries[entry_id] = _Entry(entry_id, num_tokens, num_bytes)
            self._pending.add(entry_id)
            self._held_bytes += num_bytes
        self._free_all([entry.entry_id for entry in victims])
        return entry_id

    def commit(self, entry_id: int, token_ids: Sequence[int]) -> bool:
        """The keep succeeded on every rank: the entry becomes findable (most recently used).

        Returns False when a live entry already holds these tokens (two equal prompts kept at once): the
        new state is redundant and is freed at once.
        """
        tokens = to_tokens(token_ids)
        with self._lock:
            entry = self._pending_entry(entry_id, "commit")
            if len(tokens) != entry.num_tokens:
                raise ValueError(
                    f"entry {entry_id} reserved {entry.num_tokens} tokens, commit gave {len(tokens)}"
                )
            self._pending.discard(entry_id)
            match = self._index.longest_match(tokens, limit=len(tokens))
            if match is not None and match[1] == len(tokens):
                self._drop(entry)
                to_free = [entry_id]
            else:
                self._lru[entry_id] = None
                self._index.add(entry_id, tokens)
                self._counts["keeps"] += 1
                to_free = []
        self._free_all(to_free)
        return not to_free

    def abort(self, entry_id: int) -> None:
        """The keep failed: uncharge and free (free_state is called: some ranks may have written it)."""
        with self._lock:
            entry = self._pending_entry(entry_id, "abort")
            self._pending.discard(entry_id)
            self._drop(entry)
        self._free_all([entry_id])

    # -- removals -----------------------------------------------------------------------------------

    def forget(self, token_ids: Sequence[int]) -> int:
        """Remove every live entry whose tokens start with token_ids; returns how many."""
        prefix = to_tokens(token_ids)
        with self._lock:
            doomed = [self._entries[i] for i in self._index.starting_with(prefix)]
            to_free = [entry.entry_id for entry in doomed if self._remove_locked(entry)]
        self._free_all(to_free)
        return len(doomed)

    def clear(self) -> int:
        """Remove every live entry (pending reservations are left to their commit or abort)."""
        with self._lock:
            doomed = [self._entries[i] for i in self._lru]
            to_free = [entry.entry_id for entry in doomed if self._remove_locked(entry)]
        self._free_all(to_free)
        return len(doomed)

    # -- introspection ------------------------------------------------------------------------------

    def stats(self) -> CacheStats:
        with self._lock:
            return CacheStats(
                **self._counts,
                held_bytes=self._held_bytes,
                budget_bytes=self._budget_bytes,
                num_entries=len(self._lru),
                num_dead=len(self._dead),
                num_pending=len(self._pending),
                num_live_states=len(self._entries),
            )

    # -- internals (called with the lock held) ------------------------------------------------------

    def _restorable_locked(self, tokens: array) -> tuple[int, int] | None:
        """(entry id, tokens) a lookup restores: the longest live match leaving >= 1 token to compute,
        when it reaches min_tokens."""
        match = self._index.longest_match(tokens, limit=len(tokens) - 1)
        return None if match is None or match[1] < self._min_tokens else match

    def _pick_victims(self, num_bytes: int) -> list[_Entry] | None:
        need = self._held_bytes + num_bytes - self._budget_bytes
        victims: list[_Entry] = []
        for entry_id in self._lru:
            if need <= 0:
                break
            entry = self._entries[entry_id]
            if entry.num_borrows == 0:
                victims.append(entry)
                need -= entry.num_bytes
        return victims if need <= 0 else None

    def _remove_locked(self, entry: _Entry) -> bool:
        """Take a live entry out of lookups; True when it was unborrowed and is now to be freed."""
        if entry.entry_id not in self._lru:
            return False  # already dead
        self._unindex(entry)
        if entry.num_borrows > 0:
            self._dead.add(entry.entry_id)
            return False
        self._drop(entry)
        return True

    def _check_borrow(self, borrow: Borrow) -> None:
        if self._borrows.get(borrow.borrow_id) != borrow.entry_id:
            raise ValueError(f"borrow {borrow.borrow_id} of entry {borrow.entry_id} is not held")

    def _release_locked(self, borrow: Borrow) -> list[int]:
        self._check_borrow(borrow)
        del self._borrows[borrow.borrow_id]
        entry = self._entries[borrow.entry_id]
        entry.num_borrows -= 1
        if entry.num_borrows > 0 or entry.entry_id not in self._dead:
            return []
        self._dead.discard(entry.entry_id)
        self._drop(entry)
        return [entry.entry_id]

    def _pending_entry(self, entry_id: int, verb: str) -> _Entry:
        if entry_id not in self._pending:
            raise ValueError(f"cannot {verb} entry {entry_id}: it is not a pending reservation")
        return self._entries[entry_id]

    def _unindex(self, entry: _Entry) -> None:
        del self._lru[entry.entry_id]
        self._index.remove(entry.entry_id)

    def _drop(self, entry: _Entry) -> None:
        """Forget an entry that is out of lookups and unborrowed, and uncharge it."""
        del self._entries[entry.entry_id]
        self._held_bytes -= entry.num_bytes

    def _free_all(self, entry_ids: list[int]) -> None:
        for entry_id in entry_ids:
            self._free_state(entry_id)
