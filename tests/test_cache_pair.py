"""Prefix sharing by KV blocks on the real engine, two ranks through the lane host (`local_engine`, tiny
model).

The oracle is each request's cold reply: the same request run alone on a pair without prefix caching.
A reply whose table starts with another prompt's cached blocks must equal it token for token (greedy
and sampled), and so must the top logits of every sampled step (both pairs record): attention and
every product are batch-invariant, so the shared KV rows are the bits a cold prefill computes.
The default model's chat turns are in test_cache_pair_default.py.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
from test_engine_pair import (
    GREEDY,
    RANK0_BYTES_PER_TOKEN,
    Reply,
    assert_nothing_held,
    pair_settings,
    request,
    sampled,
    submit_together,
    watch_joint_passes,
)
from tiny_models import write_tiny_model

from bench.prompt_cache import run_prompt_cache
from tpserve.ranks.settings import EngineSettings
from tpserve.server.grpc_server import GrpcServer
from tpserve.server.kv_blocks import BlockStats
from tpserve.server.lane_stream import Stream
from tpserve.server.requests import Finished, GenerationRequest, TokenDelta
from tpserve.server.servicer import ServingInfo
from tpserve.server.tokenizer import Tokenizer
from tpserve.server.wiring import LocalEngine, local_engine

BLOCK = EngineSettings(model_dir="", device="cpu").kv_block_size  # cached prefixes are whole blocks
EVENT_TIMEOUT_S = 30.0
ROOMY_TOKENS = 2048  # the roomy pair's pool: every prefix these tests compute stays cached
SMALL_TOKENS = 128  # eight blocks, not two prompts: new prompts evict the cached ones

# Two long shared prefixes (a system block, a chat history) and short tails that differ.
HISTORY_A = tuple(3 + (11 * i + 5) % 290 for i in range(80))
HISTORY_B = tuple(3 + (13 * i + 7) % 290 for i in range(72))
SEED_A = request(HISTORY_A + (40, 41, 42), 6, GREEDY)  # its blocks stay cached: later ones share them
SEED_B = request(HISTORY_B + (50, 51), 6, sampled(7))
WARM_A = (
    request(HISTORY_A + (9, 8, 7, 6), 20, GREEDY),
    request(HISTORY_A + (9, 8, 7, 6), 20, sampled(11)),  # the same prompt sampled: off the greedy path
)
TOGETHER = (  # set up together: each shares its own history's blocks
    request(HISTORY_A + (60, 61, 62), 12, GREEDY),
    request(HISTORY_B + (63, 64), 12, sampled(12)),
    request(HISTORY_A + (65,), 12, sampled(13)),
    request(HISTORY_B + (66, 67, 68, 69), 12, GREEDY),
)
# The small pool: B's blocks evict A's, A's again evict B's, and so on.
SMALL_BUDGET_RUN = (
    SEED_A,
    SEED_B,
    request(HISTORY_A + (70, 71), 10, sampled(14)),
    request(HISTORY_B + (72,), 10, GREEDY),
    request(HISTORY_B + (73, 74), 10, sampled(15)),
)

# A chat on the tiny model's template: the second turn repeats the first turn's prompt and reply.
SYSTEM = "You are a terse assistant for tensor parallel serving. " * 3
FIRST_QUESTION = "hello world, the quick brown fox jumps over the lazy dog"
SECOND_QUESTION = "tensor parallel serving, hello"


def cache_settings(model_dir: str, room_tokens: int, prefix_caching: bool = True) -> EngineSettings:
    """The tiny pair of test_engine_pair with prefix caching, and prompt passes that take whole prompts."""
    budget = room_tokens * RANK0_BYTES_PER_TOKEN
    return pair_settings(
        model_dir,
        max_prefill_tokens=128,
        kv_budget_bytes=(budget, budget),
        prefix_caching=prefix_caching,
        refuse_token_on_rank=None,
    )


def chat_turn(tokenizer: Tokenizer, first_reply: Sequence[int] | None) -> GenerationRequest:
    """The first turn's request, or (given its reply) the second turn's: history plus a new message."""
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": FIRST_QUESTION}]
    if first_reply is not None:
        messages += [
            {"role": "assistant", "content": tokenizer.decode(first_reply)},
            {"role": "user", "content": SECOND_QUESTION},
        ]
    sampling = GREEDY if first_reply is None else sampled(21)
    return request(tokenizer.encode_chat(messages), 16, sampling)


# ---- driving the host -------------------------------------------------------------------------


@dataclass(frozen=True)
class Outcome:
    """What a user gets, plus the top logits of every sampled step (the recorder's), which differ on
    any wrong KV row even where a tiny random model would still pick the same tokens."""

    reply: Reply
    steps: tuple  # (position, fed, sampled, top logits) of each step that sampled


@dataclass
class Pair:
    """A started pair and the folder its recorder writes one file per stream into."""

    engine: LocalEngine
    record_dir: Path

    @property
    def cache(self) -> BlockStats:
        return self.engine.host.block_stats()

    def serve_alone(self, requests: Sequence[GenerationRequest]) -> list[tuple[Outcome, int]]:
        return self._outcomes([read_served(self.engine.host.submit(r)) for r in requests])

    def serve_together(self, requests: Sequence[GenerationRequest]) -> list[tuple[Outcome, int]]:
        """Submitted in one instant; lanes open in queue order, so stream files follow `requests`."""
        return self._outcomes([read_served(s) for s in submit_together(self.engine.host, requests)])

    def _outcomes(self, served: list[tuple[Reply, int]]) -> list[tuple[Outcome, int]]:
        files = sorted(self.record_dir.glob("stream-*.jsonl"))[-len(served) :]
        return [(Outcome(reply, sampled_steps(f)), cached) for (reply, cached), f in zip(served, files)]


@contextmanager
def started_pair(settings: EngineSettings, record_dir: Path) -> Iterator[Pair]:
    with local_engine(settings, record_dir=str(record_dir)) as engine:
        yield Pair(engine, record_dir)


def sampled_steps(stream_file: Path) -> tuple:
    steps = []
    for line in stream_file.read_text().splitlines():
        step = json.loads(line)
        if "sampled" in step:
            features = tuple(tuple(pair) for pair in step["features"])
            steps.append((step["position"], step["fed"], step["sampled"], features))
    return tuple(steps)


def read_served(stream: Stream) -> tuple[Reply, int]:
    """The whole reply and the prompt tokens its usage says came from the cache."""
    tokens: list[int] = []
    for event in stream.events(timeout_each=EVENT_TIMEOUT_S):
        if isinstance(event, TokenDelta):
            tokens.extend(event.token_ids)
        elif isinstance(event, Finished):
            reply = Reply(tuple(tokens), event.reason, event.usage.completion_tokens, event.error)
            return reply, event.usage.cached_tokens
    raise AssertionError("the stream ended without Finished")


def assert_books_balance(pair: Pair) -> None:
    """Every lane and every block free (cached prefixes stay, held by no stream), on every rank's books."""
    assert_nothing_held(pair.engine.host)
    engine = pair.engine.runtime.engine
    assert engine.lanes == {} and engine.refs == {}
    stats = pair.cache
    assert stats.num_used == 0 and stats.num_cached <= stats.num_blocks


# ---- fixtures -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return str(write_tiny_model(tmp_path_factory.mktemp("cache") / "llama", "llama"))


@pytest.fixture(scope="module")
def tokenizer(model_dir) -> Tokenizer:
    return Tokenizer.from_model_dir(model_dir)


@pytest.fixture(scope="module")
def cold(model_dir, tokenizer, tmp_path_factory) -> dict[GenerationRequest, Outcome]:
    """Every request of these tests run alone on a pair without prefix caching: the oracle."""
    with started_pair(
        cache_settings(model_dir, ROOMY_TOKENS, False), tmp_path_factory.mktemp("cold")
    ) as pair:
        requests = [SEED_A, SEED_B, *WARM_A, *TOGETHER, *SMALL_BUDGET_RUN]
        outcomes = {r: outcome for r, (outcome, _) in zip(requests, pair.serve_alone(requests))}
        first = chat_turn(tokenizer, None)
        ((outcomes[first], _),) = pair.serve_alone([first])
        second = chat_turn(tokenizer, outcomes[first].reply.token_ids)
        ((outcomes[second], _),) = pair.serve_alone([second])
    for outcome in outcomes.values():
        assert outcome.reply.reason == "length" and outcome.reply.error is None
        assert len(outcome.steps) == len(outcome.reply.token_ids)
    return outcomes


class TestRoomyCache:
    """One pair whose pool holds everything these tests compute; cached blocks outlive each test."""

    @pytest.fixture(scope="class")
    @classmethod
    def pair(cls, model_dir, cold, tmp_path_factory):
        settings = cache_settings(model_dir, ROOMY_TOKENS)
        with started_pair(settings, tmp_path_factory.mktemp("roomy")) as pair:
            yield pair

    def test_a_shared_prefix_is_shared_and_replies_equal_the_cold_ones(self, pair, cold):
        ((seed, seed_cached),) = pair.serve_alone([SEED_A])
        assert seed_cached == 0, "nothing was cached before the first prompt"
        assert seed == cold[SEED_A]
        served = pair.serve_alone(WARM_A)
        for req, (outcome, cached) in zip(WARM_A, served):
            # The shared history's whole blocks; the rest of the prompt was prefilled on top of them.
            assert len(HISTORY_A) // BLOCK * BLOCK <= cached < len(req.prompt_ids)
            assert outcome == cold[req]
        greedy, sampled_ = (outcome.reply.token_ids for outcome, _ in served)
        assert greedy != sampled_  # sampling really left the greedy path
        assert pair.cache.hits >= 2
        assert_books_balance(pair)

    def test_jobs_set_up_together_each_share_their_own_prefix(self, pair, cold):
        pair.serve_alone([SEED_A, SEED_B])  # both histories are cached (or already were)
        hits_before = pair.cache.hits
        with watch_joint_passes(pair.engine.leader) as joint:
            served = pair.serve_together(TOGETHER)
        print(f"joint prompt passes (prompts in each): {joint.accepted}")
        assert joint.accepted and max(joint.accepted) >= 2
        for req, (outcome, cached) in zip(TOGETHER, served):
            history = HISTORY_A if req.prompt_ids[: len(HISTORY_A)] == HISTORY_A else HISTORY_B
            assert len(history) // BLOCK * BLOCK <= cached < len(req.prompt_ids)
            assert outcome == cold[req]
        assert pair.cache.hits == hits_before + len(TOGETHER)
        assert_books_balance(pair)

    def test_a_chat_second_turn_reuses_the_first_turn(self, pair, cold, tokenizer):
        first = chat_turn(tokenizer, None)
        assert len(first.prompt_ids) > 128, "longer than one prompt pass: the first turn goes in chunks"
        ((first_outcome, _),) = pair.serve_alone([first])
        assert first_outcome == cold[first]
        second = chat_turn(tokenizer, first_outcome.reply.token_ids)
        ((second_outcome, cached),) = pair.serve_alone([second])
        # The second turn starts with the first turn's whole prompt, whose blocks (and its reply's)
        # stayed cached (the reply's first token may merge with the turn's last one).
        shared = next(
            (i for i, (a, b) in enumerate(zip(first.prompt_ids, second.prompt_ids)) if a != b),
            len(first.prompt_ids),
        )
        assert shared >= len(first.prompt_ids) - 1
        assert cached >= shared // BLOCK * BLOCK
        assert second_outcome == cold[second]
        assert_books_balance(pair)


class TestSmallCache:
    """A pool that holds about two prompts: cached blocks are evicted, misses follow, replies stay exact."""

    @pytest.fixture(scope="class")
    @classmethod
    def pair(cls, model_dir, cold, tmp_path_factory):
        settings = cache_settings(model_dir, SMALL_TOKENS)
        with started_pair(settings, tmp_path_factory.mktemp("small")) as pair:
            yield pair

    def test_eviction_leaves_the_replies_exact(self, pair, cold):
        served = pair.serve_alone(SMALL_BUDGET_RUN)
        assert [outcome for outcome, _ in served] == [cold[r] for r in SMALL_BUDGET_RUN]
        assert pair.cache.evictions >= 1 and pair.cache.hits >= 1
        assert_books_balance(pair)

    def test_evicting_under_jobs_set_up_together_leaves_every_reply_exact(self, pair, cold):
        pair.serve_alone(SMALL_BUDGET_RUN[:2])
        evictions = pair.cache.evictions
        served = pair.serve_together(TOGETHER)
        assert [outcome for outcome, _ in served] == [cold[r] for r in TOGETHER]
        assert pair.cache.evictions > evictions
        assert_books_balance(pair)

    def test_metrics_read_the_blocks_at_scrape_time(self, pair, tokenizer):
        pair.serve_alone(SMALL_BUDGET_RUN[:2] + SMALL_BUDGET_RUN[4:])
        info = ServingInfo("tiny", tp_size=2, num_lanes=8, context_size=256, room=pair.engine.leader.room)
        page = GrpcServer(pair.engine.host, tokenizer, info).metrics.render().decode()  # never started
        values = {
            line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in page.splitlines()
            if line and not line.startswith("#")
        }
        stats = pair.cache
        assert stats.evictions >= 1 and stats.hits >= 1 and stats.lookups > stats.hits
        assert values['tpserve_prompt_cache_lookups_total{result="hit"}'] == stats.hits
        assert values['tpserve_prompt_cache_lookups_total{result="miss"}'] == stats.lookups - stats.hits
        assert values["tpserve_prompt_cache_hit_tokens_total"] == stats.hit_tokens
        assert values["tpserve_prompt_cache_evictions_total"] == stats.evictions
        assert values["tpserve_prompt_cache_blocks"] == stats.num_cached > 0
        assert values["tpserve_kv_blocks_used"] == 0
        assert values["tpserve_kv_blocks"] * values["tpserve_kv_block_size"] == SMALL_TOKENS


def test_the_benchmark_shares_the_history_and_finds_the_replies_identical(model_dir):
    # bench/prompt_cache.py end to end on the tiny model: speed is not asserted (a shared machine).
    report = run_prompt_cache(model_dir, history_tokens=100, max_tokens=6, num_rounds=2)
    off, on = report["modes"]
    assert (off["prefix_caching"], on["prefix_caching"]) == (False, True)
    assert report["replies_identical"] is True and report["differing_rounds"] == []
    for cold_round, warm_round in zip(off["rounds"], on["rounds"]):
        assert cold_round["second_cached_tokens"] == 0
        assert warm_round["second_cached_tokens"] >= (warm_round["first_prompt_tokens"] - 1) // BLOCK * BLOCK
        assert len(warm_round["second_reply"]) == 6
    assert on["cache_hits"] == 2 and report["second_first_token_ratio"] > 0
