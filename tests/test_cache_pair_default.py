"""Prefix sharing on the shipped default model (SmolLM2-135M-Instruct), two ranks, no gRPC: a chat's
second turn shares the first turn's cached blocks (a history of several hundred tokens) and its
replies, greedy and sampled, equal those of a pair without prefix caching token for token and logit
for logit.

The helpers are those of test_cache_pair.py (tiny model).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace

import pytest
from test_cache_pair import BLOCK, Outcome, Pair, assert_books_balance, started_pair
from test_engine_pair import GREEDY, request, sampled

from tpserve.ranks.settings import EngineSettings
from tpserve.server.requests import GenerationRequest
from tpserve.server.tokenizer import Tokenizer

pytestmark = pytest.mark.slow

SYSTEM = "You are a careful assistant. Answer in plain words, briefly, and say when you are unsure."
TOPICS = ("rivers", "bridges", "libraries", "volcanoes", "gardens", "trains", "comets", "bees")
SECOND_QUESTION = "Thank you. Which of those would you visit first, and why?"


def first_question() -> str:
    """A long first message (notes pasted into the chat), so the history runs to several hundred tokens."""
    notes = " ".join(
        f"Note {i + 1}: I read that {topic} change slowly over many years, that people who study "
        f"{topic} keep careful records, and that a visit to see {topic} is best planned in spring."
        for i, topic in enumerate(TOPICS * 2)
    )
    return f"Here are my travel notes. {notes} Which three places should I see?"


def chat_turn(tokenizer: Tokenizer, first_reply: tuple[int, ...] | None) -> GenerationRequest:
    """The first turn, or (given its reply) the second: the whole history plus a new message."""
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": first_question()}]
    if first_reply is not None:
        messages += [
            {"role": "assistant", "content": tokenizer.decode(first_reply)},
            {"role": "user", "content": SECOND_QUESTION},
        ]
    return request(tokenizer.encode_chat(messages), 20, GREEDY)


def settings_for(model_dir: str, prefix_caching: bool) -> EngineSettings:
    return EngineSettings(
        model_dir=model_dir,
        device="cpu",  # the CPU, also on a GPU host (tests/conftest.py: gpu tests are marked)
        num_lanes=2,
        context_size=1024,
        prefix_caching=prefix_caching,
        threads_per_rank=1,
        init_timeout_s=60.0,
        collective_timeout_s=120.0,
    )


def second_turns(tokenizer: Tokenizer, first_reply: tuple[int, ...]) -> list[GenerationRequest]:
    greedy = chat_turn(tokenizer, first_reply)
    return [greedy, replace(greedy, sampling=sampled(5))]


@dataclass
class Chat:
    first: GenerationRequest
    turns: list[GenerationRequest]  # the second turn, greedy then sampled
    cold: dict[GenerationRequest, Outcome]  # every turn on a pair with no cache
    served: list[tuple[Outcome, int]]  # the second turns on the cached pair, with cached tokens
    pair: Pair  # the cached pair, still running


@pytest.fixture(scope="module")
def chat(default_model, tmp_path_factory) -> Iterator[Chat]:
    tokenizer = Tokenizer.from_model_dir(default_model)
    first = chat_turn(tokenizer, None)
    with started_pair(settings_for(default_model, False), tmp_path_factory.mktemp("cold")) as cold_pair:
        ((cold_first, _),) = cold_pair.serve_alone([first])
        cold_turns = second_turns(tokenizer, cold_first.reply.token_ids)
        cold = {r: outcome for r, (outcome, _) in zip(cold_turns, cold_pair.serve_alone(cold_turns))}
    cold[first] = cold_first
    settings = settings_for(default_model, True)
    with started_pair(settings, tmp_path_factory.mktemp("warm")) as pair:
        ((warm_first, first_cached),) = pair.serve_alone([first])
        assert first_cached == 0
        # The same first reply (a cold prefill on both pairs), so the same second turn.
        assert warm_first.reply == cold_first.reply
        turns = second_turns(tokenizer, warm_first.reply.token_ids)
        served = pair.serve_alone(turns)
        print(
            f"default model: first turn {len(first.prompt_ids)} prompt tokens, second turn "
            f"{len(turns[0].prompt_ids)}; cached {[cached for _, cached in served]}"
        )
        yield Chat(first, turns, cold, served, pair)


def test_a_chat_second_turn_shares_its_history_and_replies_as_cold(chat):
    for turn, (outcome, cached) in zip(chat.turns, chat.served):
        assert 300 <= (len(chat.first.prompt_ids) - 1) // BLOCK * BLOCK <= cached < len(turn.prompt_ids)
        assert outcome.reply == chat.cold[turn].reply
    greedy, sampled_ = (outcome.reply.token_ids for outcome, _ in chat.served)
    assert greedy != sampled_  # sampling really left the greedy path
    assert_books_balance(chat.pair)


def test_a_chat_second_turn_has_the_cold_logits_bit_for_bit(chat):
    for turn, (outcome, _) in zip(chat.turns, chat.served):
        assert outcome.steps == chat.cold[turn].steps
