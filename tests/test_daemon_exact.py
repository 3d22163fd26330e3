"""Through the real daemon: every reply is exactly the reply its prompt gets alone.

Twelve requests at once with prompts of 5 to 900 tokens (the long ones prefilled in chunks of
max_prefill_tokens, the short ones in joint passes, all decoding in shared rounds), greedy and
sampled, beside a chat's second turn whose history comes from the prompt cache; with float32 weights
and with int8 ones.
"""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import pytest
from daemon import read_reply, running_daemon, write_daemon_model

from tpserve.v1 import serving_pb2

PROMPT_LENGTHS = (5, 9, 17, 33, 64, 100, 188, 255, 257, 400, 700, 900)
MAX_TOKENS = 24
FIRST_TURN = [("system", "You answer in few words. " * 8), ("user", "Tell me about the sea, please.")]


def requests_of(rng: random.Random) -> list[serving_pb2.GenerateRequest]:
    requests = []
    for index, length in enumerate(PROMPT_LENGTHS):
        ids = [rng.randrange(3, 259) for _ in range(length)]  # bytes, no special tokens
        request = serving_pb2.GenerateRequest(prompt_token_ids=ids, max_tokens=MAX_TOKENS, ignore_eos=True)
        if index % 2:
            request.temperature, request.top_p, request.seed = 0.9, 0.95, rng.randrange(2**40)
        requests.append(request)
    return requests


def chat(turns, **fields) -> serving_pb2.GenerateRequest:
    request = serving_pb2.GenerateRequest(max_tokens=MAX_TOKENS, ignore_eos=True, **fields)
    for role, content in turns:
        request.messages.add(role=role, content=content)
    return request


@pytest.fixture(scope="module", params=["none", "int8"], ids=["float32", "int8"])
def served(tmp_path_factory, request):
    model_dir = write_daemon_model(tmp_path_factory.mktemp("exact-model"))
    args = ("--lanes", "13", "--context", "1024", "--max-prefill-tokens", "128", "--queue-size", "32")
    args += ("--quantize", request.param)
    with running_daemon("spawn", model_dir, tmp_path_factory.mktemp("exact-logs"), *args) as daemon:
        yield daemon


def test_concurrent_replies_and_a_cached_chat_turn_equal_their_solo_runs(served):
    def generate(request):
        return read_reply(served.stub.Generate(request, timeout=300))

    requests = requests_of(random.Random(11))
    first = generate(chat(FIRST_TURN))
    assert first.ok
    second_turn = FIRST_TURN + [("assistant", first.text), ("user", "And about rivers?")]
    sampled_turn = chat(second_turn, temperature=0.8, seed=5)
    # Alone, one at a time: the oracle. The second turn's history was kept by the first turn.
    solo = [generate(request) for request in [*requests, chat(second_turn), sampled_turn]]
    assert all(reply.ok and len(reply.token_ids) == MAX_TOKENS for reply in solo)
    with ThreadPoolExecutor(len(solo)) as pool:
        together = list(pool.map(generate, [*requests, chat(second_turn), sampled_turn]))
    differing = [
        i
        for i, (alone, joint) in enumerate(zip(solo, together))
        if (alone.token_ids, alone.text) != (joint.token_ids, joint.text)
    ]
    assert differing == [], f"replies {differing} differ from their solo runs"
    assert all(reply.last.usage.cached_tokens > 0 for reply in together[-2:]), (
        "the history came from the cache"
    )
    # The sampled requests really sampled: they left the greedy path.
    greedy = generate(
        serving_pb2.GenerateRequest(
            prompt_token_ids=requests[1].prompt_token_ids, max_tokens=MAX_TOKENS, ignore_eos=True
        )
    )
    assert greedy.token_ids != solo[1].token_ids
