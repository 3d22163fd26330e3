"""A prompt's own log probabilities, against the real two-rank daemon on loopback: `echo` with
`logprobs` on /v1/completions (what lm-eval's loglikelihood tasks send) and vLLM's
`prompt_logprobs`, whole prompts and prompts prefilled in chunks, alone and batched, cached or not,
equal to what a tp=1 model in this process computes for the same tokens.
"""

from __future__ import annotations

import math
import random
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import torch
from daemon import read_reply, running_daemon, write_daemon_model
from engine_lanes import open_lane

from tpserve.kernels.attention_kernels import kv_dtype
from tpserve.kernels.linear import ROW_TILE
from tpserve.ranks.engine import Engine
from tpserve.ranks.kv_store import KVPool
from tpserve.ranks.loader import load_rank_model
from tpserve.v1 import serving_pb2

MAX_PREFILL = 32  # a 90-token prompt goes in three chunks


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_daemon_model(tmp_path_factory.mktemp("prompt-logprobs-model"))


@pytest.fixture(scope="module")
def daemon(model_dir, tmp_path_factory):
    args = ("--context", "512", "--lanes", "4", "--max-prefill-tokens", str(MAX_PREFILL))
    with running_daemon("spawn", model_dir, tmp_path_factory.mktemp("prompt-logprobs-logs"), *args) as served:
        yield served


@pytest.fixture(scope="module")
def client(daemon):
    with openai.OpenAI(base_url=daemon.http_url, api_key="unused", max_retries=0, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def reference(model_dir):
    """The log probability of each prompt token after the first, from a tp=1 model here."""
    torch.set_num_threads(1)
    model = load_rank_model(
        model_dir, tp_rank=0, tp_size=1, dtype=torch.float32, max_positions=512, row_tile=ROW_TILE
    )
    # The KV pool's type as the daemon picks it (float16 beside the C attention kernel).
    kv = KVPool(
        model.config.num_layers,
        256,
        model.kv_heads_per_piece(),
        model.config.head_dim,
        kv_dtype("auto", model.attention, torch.float32),
    )
    engine = Engine(model, kv)

    def logprobs_of(ids: list[int]) -> list[float]:
        open_lane(engine, 0, len(ids))
        logits = engine.forward([(0, 0, tuple(ids))], every_row=True)  # [len(ids), vocab]
        engine.release(0)
        rows = torch.log_softmax(logits.double(), dim=-1)
        return [rows[k, ids[k + 1]].item() for k in range(len(ids) - 1)]

    return logprobs_of


def prompt_of(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 259) for _ in range(length)]


def echo_logprobs(client, prompt, **fields):
    reply = client.completions.create(
        model=None,
        prompt=prompt,
        max_tokens=1,
        temperature=0,  # the reply's token too is the same every time
        echo=True,
        logprobs=2,
        extra_body={"ignore_eos": True},
        **fields,
    )
    return reply.choices[0]


@pytest.mark.parametrize("length", [5, 90], ids=["whole", "chunked"])
def test_echo_with_logprobs_scores_the_prompt_as_a_tp1_model_does(client, reference, length):
    ids = prompt_of(length, length)
    choice = echo_logprobs(client, ids)
    lp = choice.logprobs
    assert len(lp.tokens) == len(ids) + 1  # the prompt's tokens, then the one reply token
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # the first has no context
    expected = reference(ids)
    got = lp.token_logprobs[1 : len(ids)]
    assert got == pytest.approx(expected, rel=1e-5, abs=1e-6)
    assert math.fsum(got) == pytest.approx(math.fsum(expected), rel=1e-6)
    # OpenAI's legacy shape: each scored token among its position's top entries (K + 1 at most).
    for token, logprob, top in zip(lp.tokens[1:], lp.token_logprobs[1:], lp.top_logprobs[1:]):
        assert top[token] == logprob and len(top) <= 3
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0


def test_prompt_logprobs_are_the_same_batched_cached_and_over_grpc(daemon, client):
    prompts = [prompt_of(seed, 40 + 7 * seed) for seed in range(6)]
    alone = [echo_logprobs(client, ids).logprobs.token_logprobs for ids in prompts]
    with ThreadPoolExecutor(len(prompts)) as pool:  # joint prompt passes and chunks beside rounds
        together = list(pool.map(lambda ids: echo_logprobs(client, ids).logprobs.token_logprobs, prompts))
    assert together == alone
    # The prompt cache now holds these prompts' blocks; asking again still computes every row.
    assert echo_logprobs(client, prompts[0]).logprobs.token_logprobs == alone[0]
    request = serving_pb2.GenerateRequest(prompt_token_ids=prompts[1], max_tokens=1, prompt_logprobs=0)
    responses = list(daemon.stub.Generate(request, timeout=120))
    first = next(r for r in responses if r.prefilled)
    assert list(first.prompt_token_ids) == prompts[1]
    assert [row.logprob for row in first.prompt_logprobs] == pytest.approx(alone[1][1 : len(prompts[1])])
    assert read_reply(daemon.stub.Generate(request, timeout=120)).ok


def test_vllms_prompt_logprobs_list_streamed_and_whole(daemon, client, reference):
    ids = prompt_of(3, 50)
    body = {"prompt": ids, "max_tokens": 2, "prompt_logprobs": 1, "ignore_eos": True}
    whole = httpx.post(f"{daemon.http_url}/completions", json=body, timeout=120).json()
    rows = whole["choices"][0]["prompt_logprobs"]
    assert rows[0] is None and len(rows) == len(ids)
    for k, row in enumerate(rows[1:], start=1):
        assert row[str(ids[k])]["logprob"] == pytest.approx(reference(ids[: k + 1])[-1], rel=1e-5, abs=1e-6)
        assert min(entry["rank"] for entry in row.values()) == 1
    assert whole["choices"][0]["logprobs"] is None  # the reply's own were not asked for
    stream = client.completions.create(
        model=None,
        prompt=ids,
        max_tokens=2,
        stream=True,
        extra_body={"prompt_logprobs": 1, "ignore_eos": True},
    )
    chunks = [chunk.choices[0].model_extra.get("prompt_logprobs") for chunk in stream]
    assert chunks[0] == rows and all(c is None for c in chunks[1:])
    chat = httpx.post(
        f"{daemon.http_url}/chat/completions",
        json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "prompt_logprobs": 0},
        timeout=120,
    ).json()
    # A chat's rows stand beside its choices, where vLLM's chat replies carry them.
    assert chat["prompt_logprobs"][0] is None and "prompt_logprobs" not in chat["choices"][0]
    too_many = httpx.post(f"{daemon.http_url}/completions", json={**body, "prompt_logprobs": 21}, timeout=60)
    assert too_many.status_code == 400 and "prompt_logprobs must be from 0 to 20" in too_many.text
