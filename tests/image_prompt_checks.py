"""Checks every image family's engine test makes the same way (test_idefics3.py, test_gemma3v.py): a
batch with and without images equals each prompt's solo run, and tp=2 equals tp=1 bit for bit.

`run_prompts(model_dir, prompts, images, tp_rank=0, tp_size=1, collectives=None)` -> (logits, tokens)
and `chat_prompt(model_dir, images, text=...)` -> (ids, the prompt's images, ...) are the family's.
"""

from __future__ import annotations

import torch
from multiproc import RankPool, world_collectives
from tiny_llava import block_image


def check_batch_equals_solo(run_prompts, chat_prompt, model_dir, sizes) -> None:
    """Two images of sizes[0] (the same text) and one of sizes[1] with other text, beside a prompt
    without one: each row of the batch is its solo run's, and the two images read apart."""
    torch.set_num_threads(1)
    first = chat_prompt(model_dir, [block_image(1, sizes[0])])
    second = chat_prompt(model_dir, [block_image(2, sizes[1])], "the lazy dog")
    other = chat_prompt(model_dir, [block_image(3, sizes[0])])  # the first's tokens, another image
    prompts = [first[0], (70, 71, 72, 73, 74), second[0], other[0]]
    images = [first[1], (), second[1], other[1]]
    together, _ = run_prompts(model_dir, prompts, images)
    for lane, (prompt, prompt_images) in enumerate(zip(prompts, images)):
        alone, _ = run_prompts(model_dir, [prompt], [prompt_images])
        assert torch.equal(together[:, lane], alone[:, 0]), f"stream {lane} differs from its solo run"
    assert first[0] == other[0] and not torch.equal(together[:, 0], together[:, 3])


def _tp2(ctx, run_prompts, model_dir, prompts, images):
    torch.set_num_threads(1)
    collectives = world_collectives(ctx, "gloo")
    return run_prompts(model_dir, prompts, images, ctx.rank, 2, collectives)


def check_tp2_equals_tp1(run_prompts, model_dir, ids, prompt_images) -> None:
    """The image prompt beside one without an image, on two gloo ranks: tp=1's tokens and logits."""
    torch.set_num_threads(1)
    prompts, images = [ids, (70, 71, 72)], [prompt_images, ()]
    solo_logits, solo_tokens = run_prompts(model_dir, prompts, images)
    with RankPool(2) as pool:
        pair_logits, pair_tokens = pool.run(_tp2, run_prompts, model_dir, prompts, images, timeout_s=120)[0]
    assert pair_tokens == solo_tokens
    torch.testing.assert_close(pair_logits, solo_logits, rtol=0, atol=0)
