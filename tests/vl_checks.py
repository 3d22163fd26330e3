"""What the Qwen-VL-style image tests share (tests/test_qwen_vl.py, tests/test_qwen3_vl.py,
tests/test_glm4v.py): our logits and greedy tokens against transformers' on the same processor outputs,
in one pass and in chunks that cut the image; a batch with and without images against each prompt's
solo run; tp=2 against tp=1 bit for bit. `image_prompt(merged, before, after)` writes a family's token
ids around one image and says where its positions start."""

from __future__ import annotations

import torch
from engine_lanes import open_lane, tiny_engine
from hf_reference import cached_greedy
from multiproc import RankPool, world_collectives
from test_tp_exact import decode_steps

from tpserve.kernels.sampling_params import SamplingParams
from tpserve.ranks.model_config import load_model_config
from tpserve.ranks.mrope import prompt_positions, span_rope
from tpserve.server.images import decode_image
from tpserve.server.qwen_vision_input import QwenVisionInput

NUM_STEPS = 6
GREEDY = SamplingParams()


def run_prompts(model_dir, prompts, images, tp_rank=0, tp_size=1, collectives=None, chunk=0):
    """Prefill `prompts` (images: per prompt, (offset, features or None on a follower, merged grid)
    or None) in one pass, or one prompt in chunks of `chunk` tokens; then NUM_STEPS greedy rounds."""
    engine = tiny_engine(model_dir, 1024, tp_rank, tp_size, collectives)
    spans, media_rows, media, ropes = [], [], [], []
    for lane, (prompt, image) in enumerate(zip(prompts, images)):
        open_lane(engine, lane, 200)
        spans.append((lane, 0, prompt))
        runs = [] if image is None else [(image[0], image[2])]
        ropes.append(span_rope(prompt_positions(len(prompt), runs), 0, len(prompt)))
        rows = [] if image is None else list(range(image[0], image[0] + image[2][0] * image[2][1]))
        media_rows.append(rows)
        if image is not None and tp_rank == 0:
            media.append(image[1])
    if chunk:
        (prompt,), (rows,), (image,) = prompts, media_rows, images
        axes = prompt_positions(len(prompt), [(image[0], image[2])])
        for start in range(0, len(prompt), chunk):
            end = min(start + chunk, len(prompt))
            here = [r for r in rows if start <= r < end]
            rope = span_rope(axes, start, end)
            feats = image[1][here[0] - rows[0] : here[-1] - rows[0] + 1] if here and tp_rank == 0 else None
            logits = engine.forward(
                [(0, start, prompt[start:end])],
                media_rows=[[r - start for r in here]],
                media=feats,
                rope=[rope],
            )
    else:
        logits = engine.forward(
            spans, media_rows=media_rows, media=torch.cat(media) if media else None, rope=ropes
        )
    positions = [len(p) for p in prompts]
    return decode_steps(engine, logits, positions, [GREEDY] * len(prompts), tp_rank, tp_size, NUM_STEPS)


def image_of(model_dir: str, data: bytes):
    """(features [tokens, ...], merged (rows, columns)) of one image: the family's preprocessor and tower,
    as the daemon picks them."""
    config = load_model_config(model_dir)
    vision = QwenVisionInput.from_model_dir(model_dir, config, "", torch.float32, encode_text=lambda text: [])
    patches, grid = vision.preprocessor.patches(decode_image(data, "image", 1 << 20))
    merge = config.vision.spatial_merge_size
    return vision.tower.features(patches, grid), (grid[1] // merge, grid[2] // merge)


def greedy_generate(model, ids: list[int], max_tokens: int, **inputs) -> list[int]:
    """transformers' own greedy reply of exactly max_tokens tokens to the prompt ids, with its media inputs."""
    prompt = torch.tensor([ids])
    with torch.no_grad():
        out = model.generate(
            input_ids=prompt,
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=max_tokens,
            min_new_tokens=max_tokens,
            do_sample=False,
            **inputs,
        )
    return out[0, len(ids) :].tolist()


def check_logits_and_greedy(model_dir, reference, inputs, prompt, image, image_token_id: int):
    """image: (offset, features, merged); inputs: the image processor's outputs. Also: the multimodal
    positions change the logits (plain 1-D positions give others). Returns our logits."""
    ids = torch.tensor([prompt])
    ours_logits, ours_tokens = run_prompts(model_dir, [prompt], [image])
    theirs_logits, theirs_tokens = cached_greedy(
        reference,
        NUM_STEPS,
        input_ids=ids,
        pixel_values=inputs["pixel_values"],
        image_grid_thw=inputs["image_grid_thw"],
        mm_token_type_ids=(ids == image_token_id).int(),
    )
    torch.testing.assert_close(ours_logits[:, 0], theirs_logits, rtol=0, atol=1e-4)
    assert [step[0] for step in ours_tokens] == theirs_tokens
    # In chunks that cut the image (a long prompt's prefill, or a cached prefix, does).
    chunked, chunked_tokens = run_prompts(model_dir, [prompt], [image], chunk=11)
    torch.testing.assert_close(chunked[:, 0], theirs_logits, rtol=0, atol=1e-4)
    assert chunked_tokens == ours_tokens
    offset, features, (rows, cols) = image
    flat_logits, _ = run_prompts(model_dir, [prompt], [(offset, features, (1, rows * cols))])
    assert (flat_logits[0, 0] - ours_logits[0, 0]).abs().max() > 1e-3
    return ours_logits


def check_batch_equals_solo(model_dir, image_prompt, first, second) -> None:
    """first, second: (features, merged) of two images, in prompts beside one without an image."""
    one, one_at = image_prompt(first[1])
    two, two_at = image_prompt(second[1], before=(60,) * 7, after=(61,))
    prompts = [one, (70, 71, 72, 73, 74), two]
    images = [(one_at, first[0], first[1]), None, (two_at, second[0], second[1])]
    together, _ = run_prompts(model_dir, prompts, images)
    for lane, (prompt, image) in enumerate(zip(prompts, images)):
        alone, _ = run_prompts(model_dir, [prompt], [image])
        assert torch.equal(together[:, lane], alone[:, 0]), f"stream {lane} differs from its solo run"


def _tp2(ctx, model_dir, prompts, images):
    torch.set_num_threads(1)
    collectives = world_collectives(ctx, "gloo")
    if ctx.rank:  # a follower holds no features (deepstack's neither): only where they go and the positions
        images = [None if i is None else (i[0], None, i[2]) for i in images]
    return run_prompts(model_dir, prompts, images, ctx.rank, 2, collectives)


def check_tp2_equals_tp1(model_dir, image_prompt, image, pool: RankPool | None = None) -> None:
    """image: (features, merged), in a prompt beside one without an image, at tp=2 (two gloo ranks)."""
    prompt, offset = image_prompt(image[1])
    prompts, images = [prompt, (70, 71, 72)], [(offset, image[0], image[1]), None]
    solo_logits, solo_tokens = run_prompts(model_dir, prompts, images)
    if pool is None:
        with RankPool(2) as own:
            pair_logits, pair_tokens = own.run(_tp2, model_dir, prompts, images, timeout_s=120)[0]
    else:
        pair_logits, pair_tokens = pool.run(_tp2, model_dir, prompts, images, timeout_s=120)[0]
    assert pair_tokens == solo_tokens
    torch.testing.assert_close(pair_logits, solo_logits, rtol=0, atol=0)
