"""A mixture of experts through the real two-rank daemon: replies batched equal replies alone, greedy
ones equal transformers' generate (Qwen3-MoE's, GLM-4.5's, which also answers a chat); so do a
sliding-window model's past its window."""

from __future__ import annotations

import pytest
import torch
from daemon import read_reply, running_daemon, solo_then_together
from hf_reference import assert_daemon_replies_are_transformers_greedy
from test_http_api import post
from tiny_hf_models import transformers, write_hf_model

from tpserve.v1 import serving_pb2

PROMPTS = [[(11 * i + 5 * n) % 250 + 3 for i in range(length)] for n, length in enumerate((5, 40, 130, 17))]
MAX_TOKENS = 12


def request(ids, **fields) -> serving_pb2.GenerateRequest:
    return serving_pb2.GenerateRequest(prompt_token_ids=ids, max_tokens=MAX_TOKENS, ignore_eos=True, **fields)


def test_qwen3_moe_replies_batched_equal_their_solo_runs_and_transformers(tmp_path):
    # with a sliding window on every layer, longer than the served context: it never binds
    window = {"use_sliding_window": True, "sliding_window": 300, "max_window_layers": 0}
    model_dir = write_hf_model(tmp_path / "qwen3-moe", "qwen3-moe", **window)
    requests = [request(ids) for ids in PROMPTS] + [request(PROMPTS[1], temperature=0.9, seed=7)]
    args = ("--lanes", "6", "--context", "256", "--max-prefill-tokens", "64")
    with running_daemon("spawn", model_dir, tmp_path / "logs", *args) as served:
        solo, together = solo_then_together(served, requests)
        note = "Qwen3MoeForCausalLM's sliding window of 300 tokens never binds at a context of 256"
        assert note in served.logs()
    assert_daemon_replies_are_transformers_greedy(model_dir, PROMPTS, solo, together, MAX_TOKENS)


def test_glm4_moe_replies_batched_equal_their_solo_runs_and_transformers_and_it_chats(tmp_path):
    model_dir = write_hf_model(tmp_path / "glm4-moe", "glm4-moe")
    requests = [request(ids) for ids in PROMPTS] + [request(PROMPTS[2], temperature=0.9, seed=3)]
    # a float32 KV pool, as transformers keeps (no near tie decided by the pool's rounding)
    args = ("--lanes", "6", "--context", "256", "--max-prefill-tokens", "64", "--kv-dtype", "float32")
    with running_daemon("spawn", model_dir, tmp_path / "logs", *args) as served:
        solo, together = solo_then_together(served, requests)
        chat = {"messages": [{"role": "user", "content": "hello there"}], "max_tokens": 6, "ignore_eos": True}
        answer = post(served, "chat/completions", chat)
    assert answer.status_code == 200, answer.text
    assert answer.json()["usage"]["completion_tokens"] == 6
    assert_daemon_replies_are_transformers_greedy(model_dir, PROMPTS, solo, together, MAX_TOKENS)


def test_a_sliding_window_model_serves_past_its_window_as_transformers_does(tmp_path):
    # Mistral with a window of 16 at a context of 256: prompts of 40 and 130 tokens outgrow it. (A
    # float32 KV pool, as transformers keeps: prompt 130's seventh token is a near tie of two logits.)
    model_dir = write_hf_model(tmp_path / "mistral", "mistral-window", sliding_window=16)
    requests = [request(ids) for ids in PROMPTS]
    args = ("--context", "256", "--kv-dtype", "float32")
    with running_daemon("spawn", model_dir, tmp_path / "logs", *args) as served:
        replies = [read_reply(served.stub.Generate(one, timeout=300)) for one in requests]
        assert "MistralForCausalLM attends within a sliding window of 16 tokens" in served.logs()
    reference = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    for ids, reply in zip(PROMPTS, replies):
        with torch.no_grad():
            out = reference.generate(
                torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None
            )
        assert reply.ok and reply.token_ids == out[0, len(ids) :].tolist()


@pytest.fixture(autouse=True)
def one_thread():
    torch.set_num_threads(1)
