"""The shipped default model (SmolLM2-135M-Instruct) on two ranks through the lane host (no gRPC):
concurrent replies and joint prompt passes equal their solo runs, in float32 and in bfloat16.

SmolLM2 has 3 KV heads, split 2+1 between the ranks. The helpers and the oracle (a request's solo
run on an idle engine) are those of test_engine_pair.py.
"""

from __future__ import annotations

import pytest
from test_engine_pair import (
    GREEDY,
    assert_nothing_held,
    read_reply,
    read_until_token,
    request,
    run_alone,
    run_together,
    sampled,
    submit_together,
    watch_joint_passes,
)

from tpserve.ranks.settings import EngineSettings
from tpserve.server.tokenizer import Tokenizer
from tpserve.server.wiring import local_engine

pytestmark = pytest.mark.slow

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain tensor parallelism in one paragraph, for a reader who knows what a matrix product is.",
    "List three prime numbers.",
    "Why is the sky blue?",
    "Name a colour.",
    "Tell me a very short story about a robot who learns to paint, in two sentences at most.",
    "2 + 2 =",
]


def requests_for(model_dir: str):
    """Eight chat prompts of different lengths, replies of different lengths, greedy and sampled."""
    tokenizer = Tokenizer.from_model_dir(model_dir)
    prompts = [tokenizer.encode_chat([{"role": "user", "content": q}]) for q in QUESTIONS]
    replies = [24, 9, 32, 5, 16, 12, 28, 7]
    samplings = [GREEDY, sampled(1), GREEDY, sampled(2), sampled(3), GREEDY, sampled(4), GREEDY]
    # Two may end early at EOS, as a user's would; the rest run their full length.
    return [
        request(prompt, num, sampling, ignore_eos=i not in (1, 5))
        for i, (prompt, num, sampling) in enumerate(zip(prompts, replies, samplings))
    ]


def settings_for(model_dir: str, dtype: str) -> EngineSettings:
    return EngineSettings(
        model_dir=model_dir,
        device="cpu",  # the CPU, also on a GPU host (tests/conftest.py: gpu tests are marked)
        dtype=dtype,
        num_lanes=8,
        context_size=256,
        threads_per_rank=1,
        init_timeout_s=60.0,
        collective_timeout_s=60.0,
        prefix_caching=False,  # replies are compared with their solo runs: no cache between the runs
    )


@pytest.fixture(scope="module")
def requests(default_model):
    return requests_for(default_model)


class TestFloat32:
    """One float32 pair for these tests; it is gone before the bfloat16 one starts."""

    @pytest.fixture(scope="class")
    @classmethod
    def pair(cls, default_model):
        with local_engine(settings_for(default_model, "float32")) as engine:
            yield engine

    @pytest.fixture(scope="class")
    @classmethod
    def solo(cls, pair, requests):
        return run_alone(pair.host, requests)

    def test_streams_joining_mid_decode_equal_their_solo_runs(self, pair, requests, solo):
        assert all(reply.error is None for reply in solo)
        assert solo[0].token_ids != solo[1].token_ids
        early = submit_together(pair.host, requests[:4])
        early_events = [read_until_token(stream) for stream in early]
        late = submit_together(pair.host, requests[4:])  # they join between the first four's rounds
        replies = [read_reply(s, e) for s, e in zip(early, early_events)] + [read_reply(s) for s in late]
        assert replies == solo
        assert_nothing_held(pair.host)

    def test_joint_prompt_pass_equals_solo_runs(self, pair, requests, solo):
        with watch_joint_passes(pair.leader) as joint:
            replies = run_together(pair.host, requests)
        print(f"default model: joint prompt passes (prompts in each): {joint.accepted}")
        assert joint.accepted and max(joint.accepted) >= 2
        assert replies == solo
        assert_nothing_held(pair.host)


def test_bfloat16_replies_equal_their_solo_runs(default_model, requests):
    with local_engine(settings_for(default_model, "bfloat16")) as engine:
        alone = run_alone(engine.host, requests)
        with watch_joint_passes(engine.leader) as joint:
            together = run_together(engine.host, requests)
    assert joint.accepted and max(joint.accepted) >= 2
    num_differing = sum(a != b for a, b in zip(alone, together))
    num_tokens = sum(a != b for x, y in zip(alone, together) for a, b in zip(x.token_ids, y.token_ids))
    print(
        f"bfloat16, default model: {num_differing} of {len(requests)} replies "
        f"({num_tokens} tokens) differ from their solo runs"
    )
    # Batch-invariant products give a row the same bits in any batch, in bfloat16 too.
    assert num_differing == 0
