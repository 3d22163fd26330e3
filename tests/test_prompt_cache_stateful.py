"""Random lookups, keeps, restores, forgets and releases checked against a plain model of the rules.

The model holds each entry's tokens, borrow count, phase and last use, and frees by the rules in their
simplest form; after every step the cache must agree with it, and free_state must never have been
called for a borrowed, pending or already freed entry.
"""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tpserve.server.prompt_cache import Borrow, PromptCache

BYTES_PER_TOKEN = 3
BUDGET_TOKENS = 60
MIN_TOKENS = 6
BLOCK_SIZE = 4
# Three shared openings (system prompts) and a two-letter tail alphabet, so prefixes often coincide.
OPENINGS = [tuple(range(10 * k, 10 * k + 12)) for k in range(3)]

prompts = st.builds(
    lambda opening, cut, tail: OPENINGS[opening][:cut] + tuple(tail),
    st.integers(0, 2),
    st.integers(0, 12),
    st.lists(st.integers(0, 1), max_size=16),
)


def shared_length(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    length = 0
    while length < min(len(a), len(b)) and a[length] == b[length]:
        length += 1
    return length


@dataclass
class ModelEntry:
    tokens: tuple[int, ...] | None
    num_borrows: int = 0
    phase: str = "pending"  # pending, live, dead
    last_use: int = 0


class PromptCacheMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.cache = PromptCache(
            BUDGET_TOKENS * BYTES_PER_TOKEN,
            BYTES_PER_TOKEN,
            free_state=self.on_free,
            min_tokens=MIN_TOKENS,
            block_size=BLOCK_SIZE,
        )
        self.model: dict[int, ModelEntry] = {}  # every id reserved and not yet freed by the model
        self.sizes: dict[int, int] = {}  # every id ever reserved -> tokens
        self.model_freed: set[int] = set()
        self.freed: list[int] = []  # free_state calls, in order
        self.borrows: list[Borrow] = []  # held by the test's "jobs"
        self.pending: dict[int, tuple[int, ...]] = {}
        self.clock = 0
        self.kept: list[tuple[int, ...]] = []  # every prompt committed so far

    def on_free(self, entry_id: int) -> None:
        assert entry_id in self.sizes, f"free_state({entry_id}) for an id reserve never gave"
        assert entry_id not in self.freed, f"free_state({entry_id}) called twice"
        assert entry_id not in {b.entry_id for b in self.borrows}, f"free_state({entry_id}) while borrowed"
        assert entry_id not in self.pending, f"free_state({entry_id}) while pending"
        self.freed.append(entry_id)

    # -- the model's rules --------------------------------------------------------------------------

    def tick(self) -> int:
        self.clock += 1
        return self.clock

    def live(self) -> dict[int, ModelEntry]:
        return {i: e for i, e in self.model.items() if e.phase == "live"}

    def model_free(self, entry_id: int) -> None:
        del self.model[entry_id]
        self.model_freed.add(entry_id)

    def model_remove(self, entry_id: int) -> None:
        entry = self.model[entry_id]
        if entry.num_borrows:
            event(f"dead entry with {entry.num_borrows} borrows")
            entry.phase = "dead"
        else:
            self.model_free(entry_id)

    def model_release(self, entry_id: int) -> None:
        entry = self.model[entry_id]
        entry.num_borrows -= 1
        if entry.phase == "dead" and entry.num_borrows == 0:
            self.model_free(entry_id)

    def held_tokens(self) -> int:
        return sum(self.sizes[i] for i in self.model)

    def best_match(self, tokens: tuple[int, ...], limit: int) -> tuple[int, int] | None:
        """(entry id, shared tokens) sharing the most, ties to the shorter entry then the lower id."""
        ranked = sorted(
            (-min(shared_length(e.tokens, tokens), limit), len(e.tokens), i) for i, e in self.live().items()
        )
        return (ranked[0][2], -ranked[0][0]) if ranked else None

    # -- rules --------------------------------------------------------------------------------------

    def draw_prompt(self, data, min_tokens: int = 0) -> tuple[int, ...]:
        """Mostly a prompt kept before (whole, cut or extended), so hits, ties and twins are common."""
        if self.kept and data.draw(st.integers(0, 3)):
            kept = data.draw(st.sampled_from(self.kept))
            cut = data.draw(st.one_of(st.just(len(kept)), st.integers(0, len(kept))))
            prompt = kept[:cut] + tuple(data.draw(st.lists(st.integers(0, 1), max_size=4)))
        else:
            prompt = data.draw(prompts)
        return prompt + (5,) * (min_tokens - len(prompt))

    @rule(data=st.data(), num_jobs=st.integers(1, 3))
    def lookup(self, data, num_jobs):
        # Jobs set up together with one prompt each borrow the same entry.
        prompt = self.draw_prompt(data)
        for _ in range(num_jobs):
            expected = self.best_match(prompt, len(prompt) - 1)
            if expected is not None and expected[1] < MIN_TOKENS:
                expected = None
            borrow = self.cache.lookup(prompt)
            assert (None if borrow is None else (borrow.entry_id, borrow.num_tokens)) == expected
            if borrow is not None:
                event("lookup hit")
                self.borrows.append(borrow)
                entry = self.model[borrow.entry_id]
                entry.num_borrows += 1
                entry.last_use = self.tick()

    @rule(data=st.data(), then=st.sampled_from(["commit", "commit", "commit", "abort", "hold"]))
    def keep(self, data, then):
        # Now and then a state bigger than the whole budget, which must be refused.
        if data.draw(st.integers(0, 9)):
            tokens = self.draw_prompt(data, MIN_TOKENS)
        else:
            tokens = (5,) * (BUDGET_TOKENS + 1)
        need = self.held_tokens() + len(tokens) - BUDGET_TOKENS
        idle = sorted((e.last_use, i) for i, e in self.live().items() if e.num_borrows == 0)
        victims = []
        for _, entry_id in idle:
            if need <= 0:
                break
            victims.append(entry_id)
            need -= self.sizes[entry_id]
        entry_id = self.cache.reserve(len(tokens))
        if need > 0:
            assert entry_id is None, "reserve charged a state that cannot fit"
            event("reserve refused with idle entries" if victims else "reserve refused")
            return
        assert entry_id is not None and entry_id not in self.sizes
        if any(self.model[i].num_borrows for i in self.live()):
            event("reserve beside a borrowed entry")
        if victims:
            event("eviction")
        for victim in victims:
            self.model_free(victim)
        self.sizes[entry_id] = len(tokens)
        self.model[entry_id] = ModelEntry(tokens=None)
        self.pending[entry_id] = tokens
        if then != "hold":
            self.finish(entry_id, then == "commit")

    @precondition(lambda self: self.pending)
    @rule(data=st.data(), succeeded=st.booleans())
    def finish_keep(self, data, succeeded):
        self.finish(data.draw(st.sampled_from(sorted(self.pending))), succeeded)

    def finish(self, entry_id: int, succeeded: bool) -> None:
        tokens = self.pending.pop(entry_id)
        if not succeeded:
            self.cache.abort(entry_id)
            self.model_free(entry_id)
            return
        covered = self.best_match(tokens, len(tokens))
        redundant = covered is not None and covered[1] == len(tokens)
        assert self.cache.commit(entry_id, tokens) is not redundant
        if redundant:
            event("redundant commit")
            self.model_free(entry_id)
        else:
            self.model[entry_id] = ModelEntry(tokens=tokens, phase="live", last_use=self.tick())
            self.kept.append(tokens)

    @precondition(lambda self: self.borrows)
    @rule(data=st.data(), restored=st.booleans())
    def finish_restore(self, data, restored):
        borrow = self.borrows.pop(data.draw(st.integers(0, len(self.borrows) - 1)))
        if restored:
            self.cache.release(borrow)
        else:
            self.cache.restore_failed(borrow)
            if self.model[borrow.entry_id].phase == "live":
                self.model[borrow.entry_id].phase = "dead"
        self.model_release(borrow.entry_id)

    @rule(data=st.data())
    def forget(self, data):
        prefix = self.draw_prompt(data)
        doomed = [i for i, e in self.live().items() if e.tokens[: len(prefix)] == prefix]
        assert self.cache.forget(prefix) == len(doomed)
        for entry_id in doomed:
            self.model_remove(entry_id)

    @rule()
    def clear(self):
        doomed = list(self.live())
        assert self.cache.clear() == len(doomed)
        for entry_id in doomed:
            self.model_remove(entry_id)

    @rule(data=st.data(), boundaries=st.lists(st.integers(0, 28)))
    def keep_points(self, data, boundaries):
        prompt = self.draw_prompt(data)
        boundaries = [b for b in boundaries if b <= len(prompt)]
        match = self.best_match(prompt, len(prompt))
        covered = 0 if match is None or match[1] < MIN_TOKENS else match[1]
        candidates = {p for p in [*boundaries, len(prompt)] if MIN_TOKENS <= p <= BUDGET_TOKENS}
        expected = sorted((p for p in candidates if p - covered >= MIN_TOKENS), reverse=True)
        assert self.cache.keep_points(prompt, boundaries) == expected

    # -- invariants ---------------------------------------------------------------------------------

    @invariant()
    def books_agree_with_the_model(self):
        stats = self.cache.stats()
        phases = [e.phase for e in self.model.values()]
        assert stats.held_bytes == self.held_tokens() * BYTES_PER_TOKEN <= stats.budget_bytes
        assert stats.num_entries == phases.count("live")
        assert stats.num_dead == phases.count("dead")
        assert stats.num_pending == phases.count("pending") == len(self.pending)
        assert stats.num_live_states == stats.num_entries + stats.num_dead + stats.num_pending
        assert stats.num_live_states == len(self.sizes) - len(self.freed)
        assert set(self.freed) == self.model_freed, "free_state calls differ from the model's frees"
        assert all(e.num_borrows > 0 for e in self.model.values() if e.phase == "dead")


PromptCacheMachine.TestCase.settings = settings(
    max_examples=200, stateful_step_count=60, deadline=None, database=None
)
test_prompt_cache_rules = PromptCacheMachine.TestCase
