"""gpt-oss with MXFP4 experts through the real two-rank daemon: replies past its sliding window equal
transformers' greedy generate on the same checkpoint (which transformers decodes itself), and
replies batched equal replies alone."""

from __future__ import annotations

import torch
from daemon import running_daemon, solo_then_together
from hf_reference import assert_daemon_replies_are_transformers_greedy
from mxfp4_models import write_mxfp4_pair
from tiny_hf_models import write_hf_model

from tpserve.v1 import serving_pb2

PROMPTS = [[(11 * i + 5 * n) % 250 + 3 for i in range(length)] for n, length in enumerate((5, 40, 130))]
MAX_TOKENS = 12


def request(ids, **fields) -> serving_pb2.GenerateRequest:
    return serving_pb2.GenerateRequest(prompt_token_ids=ids, max_tokens=MAX_TOKENS, ignore_eos=True, **fields)


def test_an_mxfp4_gpt_oss_serves_transformers_greedy_tokens_batched_or_alone(tmp_path):
    torch.set_num_threads(1)
    model_dir, _ = write_mxfp4_pair(
        write_hf_model(tmp_path / "source", "gpt-oss", intermediate_size=64), tmp_path
    )
    requests = [request(ids) for ids in PROMPTS] + [request(PROMPTS[1], temperature=0.9, seed=7)]
    # a float32 KV pool, as transformers keeps (no near tie decided by the pool's rounding)
    args = ("--lanes", "6", "--context", "256", "--max-prefill-tokens", "64", "--kv-dtype", "float32")
    with running_daemon("spawn", model_dir, tmp_path / "logs", *args) as served:
        solo, together = solo_then_together(served, requests)
        assert "GptOssForCausalLM attends within a sliding window of 8 tokens" in served.logs()
        assert "its mxfp4 experts dequantized exactly to dtype" in served.logs()
    assert_daemon_replies_are_transformers_greedy(model_dir, PROMPTS, solo, together, MAX_TOKENS)
