"""The shipped default model (SmolLM2-135M-Instruct): two ranks give one rank's tokens, and one
rank gives what an independent implementation (transformers, loading the same GGUF) gives."""

from __future__ import annotations

import pytest

from tpserve.generate import generate_tokens
from tpserve.kernels.sampling_params import SamplingParams
from tpserve.prepare import find_default_gguf
from tpserve.ranks.settings import EngineSettings
from tpserve.server.tokenizer import Tokenizer

pytestmark = pytest.mark.slow

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain tensor parallelism in one paragraph.",
    "List three prime numbers and say why they are prime.",
]
NUM_TOKENS = 64
# bfloat16 products run several times slower than float32 on a CPU without bf16 instructions
# (AVX2 only): its check takes fewer, shorter replies, so the slow suite fits any such machine.
BF16_QUESTIONS, BF16_TOKENS = 2, 24
SAMPLED = SamplingParams(temperature=0.8, top_p=0.95, top_k=50, seed=1234)


def prompts(model_dir: str, questions=QUESTIONS) -> list[list[int]]:
    tokenizer = Tokenizer.from_model_dir(model_dir)
    return [tokenizer.encode_chat([{"role": "user", "content": q}]) for q in questions]


def run(model_dir: str, tp: int, dtype: str, questions=QUESTIONS, num_tokens=NUM_TOKENS) -> list[list[int]]:
    ids = prompts(model_dir, questions)
    settings = EngineSettings(
        model_dir=model_dir, device="cpu", dtype=dtype, tp_size=tp, num_lanes=1, context_size=256
    )
    jobs = [(p, SamplingParams()) for p in ids] + [(p, SAMPLED) for p in ids]
    # No eos: every reply runs the full num_tokens, so every position is compared.
    return [g.token_ids for g in generate_tokens(settings, jobs, num_tokens, eos_ids=frozenset())]


@pytest.fixture(scope="module")
def tp1_float32(default_model):
    return run(default_model, 1, "float32")


def test_two_ranks_equal_one_float32(default_model, tp1_float32):
    assert run(default_model, 2, "float32") == tp1_float32
    # The sampled replies are not the greedy ones: sampling really happened.
    half = len(QUESTIONS)
    assert tp1_float32[:half] != tp1_float32[half:]


def test_two_ranks_equal_one_bfloat16(default_model):
    one, two = (run(default_model, tp, "bfloat16", QUESTIONS[:BF16_QUESTIONS], BF16_TOKENS) for tp in (1, 2))
    differing = sum(a != b for x, y in zip(one, two) for a, b in zip(x, y))
    print(f"bfloat16: {differing} of {len(one) * BF16_TOKENS} tokens differ between tp=1 and tp=2")
    assert differing == 0


def test_greedy_equals_transformers_reference(default_model, tp1_float32):
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    gguf = find_default_gguf()
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    )
    # Our runs go past EOS (no eos ids), so the reference must too, without suppressing EOS.
    reference.generation_config.eos_token_id = None
    reference.generation_config.pad_token_id = 0
    for prompt, ours in zip(prompts(default_model), tp1_float32):
        with torch.no_grad():
            out = reference.generate(torch.tensor([prompt]), max_new_tokens=NUM_TOKENS, do_sample=False)
        assert out[0, len(prompt) :].tolist() == ours
