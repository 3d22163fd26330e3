"""Our model against transformers' own forward on the same files (logits and greedy tokens), and against
itself (a prompt in chunks against the whole prompt)."""

from __future__ import annotations

import pytest
import torch
from engine_lanes import open_lane

from tpserve.kernels.linear import ROW_TILE
from tpserve.ranks.engine import Engine
from tpserve.ranks.kv_store import KVPool
from tpserve.ranks.loader import load_rank_model

transformers = pytest.importorskip("transformers")

PROMPTS = [tuple((7 * i + 3) % 300 for i in range(90)), (5, 17, 99, 3, 42), (11,)]
NUM_GREEDY = 8


def engine_of(model_dir, row_tile: int, max_positions: int = 256, num_slots: int = 256) -> Engine:
    model = load_rank_model(
        model_dir, tp_rank=0, tp_size=1, dtype=torch.float32, max_positions=max_positions, row_tile=row_tile
    )
    kv = KVPool(
        model.config.num_layers, num_slots, model.kv_heads_per_piece(), model.config.head_dim, torch.float32
    )
    return Engine(model, kv)


def check_against_transformers(
    model_dir, row_tile: int, max_positions: int = 256, reference_dir=None
) -> None:
    """A 90-token prompt in two chunks then two decode steps: logits within float32 rounding of
    transformers'; and for several prompts the same greedy tokens as transformers' generate.
    reference_dir: the transformers checkpoint of the same model, where model_dir is not one (a GGUF
    import)."""
    torch.set_num_threads(1)
    engine = engine_of(model_dir, row_tile, max_positions)
    ids = PROMPTS[0]
    open_lane(engine, 0, 100)
    ours = [engine.forward([(0, 0, ids[:50])]), engine.forward([(0, 50, ids[50:88])])]
    ours += [engine.forward([(0, 88, ids[88:89])]), engine.forward([(0, 89, ids[89:90])])]
    # a mixture of experts in transformers' plain loop over experts (its grouped products need
    # 16-byte strides, which tiny odd expert widths do not have)
    eager = {"experts_implementation": "eager"} if engine.model.config.moe else {}
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        reference_dir or model_dir, dtype=torch.float32, **eager
    )
    with torch.no_grad():
        expected = reference(torch.tensor([ids])).logits[0]
    for got, row in zip(ours, (49, 87, 88, 89)):
        torch.testing.assert_close(got[0], expected[row], rtol=1e-4, atol=1e-4)
    engine.release(0)
    for lane, prompt in enumerate(PROMPTS):
        open_lane(engine, 1 + lane, len(prompt) + NUM_GREEDY)
        tokens, logits = [], engine.forward([(1 + lane, 0, prompt)])
        for step in range(NUM_GREEDY):
            tokens.append(int(logits[0].argmax()))
            logits = engine.forward([(1 + lane, len(prompt) + step, (tokens[-1],))])
        with torch.no_grad():
            generated = reference.generate(
                torch.tensor([prompt]), max_new_tokens=NUM_GREEDY, do_sample=False, eos_token_id=None
            )
        assert tokens == generated[0, len(prompt) :].tolist(), f"prompt {lane}: greedy tokens differ"
        engine.release(1 + lane)


def check_chunks_equal_whole(model_dir, first_cut: int) -> None:
    """A 70-token prompt in chunks cut at first_cut, 68 and 69 (the last two: decode-sized) ends on
    the logits of the whole prompt in one pass, bit for bit."""
    torch.set_num_threads(1)
    engine = engine_of(model_dir, ROW_TILE)
    ids = tuple((5 * i + 2) % 250 for i in range(70))
    open_lane(engine, 0, 80)
    open_lane(engine, 1, 80)
    whole = engine.forward([(1, 0, ids)])
    parts = [engine.forward([(0, 0, ids[:first_cut])]), engine.forward([(0, first_cut, ids[first_cut:68])])]
    parts += [engine.forward([(0, 68, ids[68:69])]), engine.forward([(0, 69, ids[69:])])]
    assert torch.equal(parts[-1], whole)


def cached_greedy(reference, num_steps: int, **inputs) -> tuple[torch.Tensor, list[int]]:
    """transformers' own greedy run from `inputs` (the prompt, its images) on its KV cache: the last
    position's logits of each of num_steps forwards [num_steps, vocab], and the greedy tokens."""
    with torch.no_grad():
        out = reference(**inputs, use_cache=True)
        logits, past, tokens = [out.logits[0, -1]], out.past_key_values, []
        for _ in range(num_steps - 1):
            tokens.append(int(logits[-1].argmax()))
            out = reference(input_ids=torch.tensor([[tokens[-1]]]), past_key_values=past, use_cache=True)
            logits.append(out.logits[0, -1])
            past = out.past_key_values
    tokens.append(int(logits[-1].argmax()))
    return torch.stack(logits), tokens


def assert_daemon_replies_are_transformers_greedy(
    model_dir, prompts, solo, together, max_tokens: int
) -> None:
    """A daemon's solo replies run to max_tokens, its concurrent ones equal them, and each is the
    greedy generate() of transformers' own model (eager experts, float32) on the same checkpoint."""
    from tiny_hf_models import transformers

    assert all(reply.ok and len(reply.token_ids) == max_tokens for reply in solo)
    assert [r.token_ids for r in together] == [r.token_ids for r in solo]
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, experts_implementation="eager"
    )
    for ids, reply in zip(prompts, solo):
        with torch.no_grad():
            out = reference.generate(
                torch.tensor([ids]), max_new_tokens=max_tokens, do_sample=False, eos_token_id=None
            )
        assert reply.token_ids == out[0, len(ids) :].tolist()
