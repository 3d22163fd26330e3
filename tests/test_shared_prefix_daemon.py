"""Concurrent chats with one long system prompt through the real two-rank daemon, over HTTP: one chat
computes the system prompt's KV blocks, every other one shares them (its usage's cached_tokens says
so), and every reply is the reply its chat gets alone on a daemon that shares nothing."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import openai
from daemon import running_daemon, write_daemon_model

NUM_CHATS = 8
MAX_TOKENS = 12
BLOCK = 32  # the daemon's kv_block_size
# 400 tokens of the byte-level vocabulary: 12 whole blocks, in chunks of 128 (--max-prefill-tokens)
SYSTEM = ("You answer in few words and keep to the facts you are given. " * 7)[:400]
ARGS = ("--lanes", str(NUM_CHATS), "--context", "512", "--max-prefill-tokens", "128")


def chat_body(index: int) -> dict:
    body = {
        "messages": [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"Question {index}: what is {index * 7} plus one?"},
        ],
        "max_tokens": MAX_TOKENS,
        "extra_body": {"ignore_eos": True},
    }
    # half greedy, half sampled with a seed of their own
    return body | ({"temperature": 0.9, "seed": index} if index % 2 else {"temperature": 0})


def ask(served, body: dict):
    client = openai.OpenAI(base_url=served.http_url, api_key="unused", max_retries=0, timeout=120)
    (model,) = client.models.list().data
    return client.chat.completions.create(model=model.id, **body)


def test_concurrent_chats_share_one_system_prompts_blocks_and_reply_as_they_do_alone(tmp_path):
    model_dir = write_daemon_model(tmp_path / "model")
    bodies = [chat_body(index) for index in range(NUM_CHATS)]
    with running_daemon("spawn", model_dir, tmp_path / "shared-logs", *ARGS) as served:
        with ThreadPoolExecutor(NUM_CHATS) as pool:
            together = list(pool.map(lambda body: ask(served, body), bodies))
        values = served.metrics()
    with running_daemon(
        "spawn", model_dir, tmp_path / "cold-logs", *ARGS, "--prefix-caching", "false"
    ) as cold:
        solo = [ask(cold, body) for body in bodies]

    cached = [reply.usage.prompt_tokens_details.cached_tokens for reply in together]
    assert sorted(cached)[0] == 0 and min(sorted(cached)[1:]) >= len(SYSTEM) // BLOCK * BLOCK, (
        f"one chat computed the system prompt, the others shared its blocks: {cached}"
    )
    assert values["tpserve_prompt_cache_hit_tokens_total"] == sum(cached)
    assert [r.usage.prompt_tokens_details.cached_tokens for r in solo] == [0] * NUM_CHATS
    differing = [
        index
        for index, (alone, joint) in enumerate(zip(solo, together))
        if alone.choices[0].message.content != joint.choices[0].message.content
    ]
    assert differing == [], f"chats {differing} replied otherwise than alone"
    assert all(reply.usage.completion_tokens == MAX_TOKENS for reply in together)
