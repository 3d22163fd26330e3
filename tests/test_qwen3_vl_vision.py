"""Qwen3-VL's vision tower (tpserve/ranks/qwen3_vision.py) against transformers' own on a tiny random
Qwen3-VL that transformers writes (tests/tiny_qwen3_vl.py): the merged features and each deepstack
merger's, for an image (a grid larger than the learned position table, so the table is resampled) and
for two temporal patches of video frames, on the same processor outputs, within float32 rounding."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image
from tiny_llava import block_image
from tiny_qwen3_vl import write_tiny_qwen3_vl

from tpserve.ranks.model_config import load_model_config
from tpserve.ranks.qwen3_vision import load_qwen3_vision_tower, position_taps
from tpserve.server.qwen_images import QwenPreprocessor


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return str(write_tiny_qwen3_vl(tmp_path_factory.mktemp("qwen3_vl")))


@pytest.fixture(scope="module")
def reference(model_dir):
    from transformers import Qwen3VLForConditionalGeneration

    return Qwen3VLForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval().model.visual


def ours(model_dir: str):
    config = load_model_config(model_dir)
    return load_qwen3_vision_tower(model_dir, config.vision, torch.float32)


def theirs(reference, patches: np.ndarray, grid) -> tuple[torch.Tensor, list[torch.Tensor]]:
    with torch.no_grad():
        out = reference(torch.from_numpy(np.ascontiguousarray(patches)), grid_thw=torch.tensor([grid]))
    return out.pooler_output, out.deepstack_features


def check_against(tower, reference, patches, grid) -> None:
    features, deepstack = tower.features_and_deepstack(patches, grid)
    expected, expected_deepstack = theirs(reference, patches, grid)
    torch.testing.assert_close(features, expected, rtol=0, atol=1e-5)
    assert len(deepstack) == len(expected_deepstack) == 1
    for got, want in zip(deepstack, expected_deepstack):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    # The deepstack rows are their own: a merger of an earlier block, not the last one's.
    assert (deepstack[0] - features).abs().max() > 1e-2


def test_an_images_features_and_deepstack_features_match_transformers(model_dir, reference):
    from transformers import Qwen2VLImageProcessorPil

    torch.set_num_threads(1)
    data = block_image(3, (70, 50))
    processor = QwenPreprocessor.from_model_dir(model_dir)
    patches, grid = processor.patches(Image.open(io.BytesIO(data)))
    processed = Qwen2VLImageProcessorPil.from_pretrained(model_dir)(images=Image.open(io.BytesIO(data)))
    assert list(grid) == list(processed["image_grid_thw"][0])
    torch.testing.assert_close(
        torch.from_numpy(patches), torch.as_tensor(processed["pixel_values"]), rtol=0, atol=1e-5
    )
    assert grid[1] > 4 and grid[2] > 4  # past the 4x4 learned table: it is resampled
    check_against(ours(model_dir), reference, patches, grid)


def test_two_temporal_patches_of_frames_match_transformers(model_dir, reference):
    torch.set_num_threads(1)
    processor = QwenPreprocessor.from_model_dir(model_dir)
    frames = [processor.pixels(Image.open(io.BytesIO(block_image(seed, (48, 64))))) for seed in range(4)]
    patches, grid = processor.patchify(np.stack(frames))
    assert grid[0] == 2
    check_against(ours(model_dir), reference, patches, grid)


def test_the_position_table_is_resampled_with_its_corners_aligned():
    taps, weights = position_taps(torch.arange(3), size=3, side=5)
    assert taps.tolist() == [[0, 1], [2, 3], [4, 4]]
    assert weights.tolist() == [[1.0, 0.0], [1.0, 0.0], [1.0, 0.0]]  # 0, 2 and 4 of a 5-row table
    taps, weights = position_taps(torch.tensor([1]), size=4, side=2)
    assert taps.tolist() == [[0, 1]] and torch.allclose(weights, torch.tensor([[2 / 3, 1 / 3]]))
