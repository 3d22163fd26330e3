"""A Qwen3-VL model's vision tower: the patch embedding over temporal patches, a learned position table
resampled to each grid, the ViT (full attention within each temporal patch, LayerNorms, a GELU MLP),
its 2-D rotary, the 2x2 patch merger and the deepstack mergers, in plain torch.

Its output is the merged features [tokens, text hidden] (one row per text position, in the processor's
order) and, for each of deepstack_visual_indexes, the same rows from a merger reading that block's
output: transformers adds those to the first text layers' hidden states at the media's positions.
It runs on rank 0 only, one image at a time, as the Qwen2.5-VL tower does (tpserve/ranks/qwen_vision.py):
the features and the deepstack rows, side by side, reach every rank through the embedding's all-reduce,
and every rank adds the deepstack rows after its first layers (tpserve/ranks/model.py).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from tpserve.ranks.errors import ModelFileError
from tpserve.ranks.qwen3_vision_config import Qwen3VisionConfig
from tpserve.ranks.qwen_vision import check_patch_embed, hw_positions, read_visual_tensors

NORM_EPS = 1e-6  # transformers' Qwen3-VL vision LayerNorms take no eps from the config


def position_taps(positions: torch.Tensor, size: int, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Bilinear resampling (corners aligned) of a `side`-long table axis to an axis of `size`: for each
    position [N], its two table rows [N, 2] and their weights [N, 2] (float32)."""
    source = positions.float() * (side - 1) / max(size - 1, 1)
    low = source.floor()
    fraction = source - low
    taps = torch.stack([low, low + 1], dim=-1).long().clamp(0, side - 1)
    return taps, torch.stack([1 - fraction, fraction], dim=-1)


class Qwen3VisionTower:
    """patches [N, C*T*P*P] of one grid (t, h, w) -> features [N / merge^2, text hidden], and one
    [N / merge^2, text hidden] per deepstack layer."""

    def __init__(self, config: Qwen3VisionConfig, tensors: dict[str, torch.Tensor]):
        self.config = config
        self.w = (
            tensors  # names without their checkpoint prefix: "patch_embed.*", "blocks.*", "merger.*", ...
        )
        self.dtype = tensors["patch_embed.proj.weight"].dtype
        self.device = tensors["patch_embed.proj.weight"].device
        quarter = config.head_dim // 2  # h and w rotate a quarter of the head each, twice over
        self.inv_freq = 1.0 / (
            config.rope_theta ** (torch.arange(0, quarter, 2, dtype=torch.float) / quarter)
        )

    def _linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return F.linear(x, self.w[name + ".weight"], self.w[name + ".bias"])

    def _norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return F.layer_norm(x, x.shape[-1:], self.w[name + ".weight"], self.w[name + ".bias"], NORM_EPS)

    def _positions(self, hw: torch.Tensor, grid) -> torch.Tensor:
        """The learned table resampled to the grid, for each patch at (row, column) hw [N, 2]: [N, hidden]."""
        side = self.config.position_side
        rows, row_weights = position_taps(hw[:, 0], grid[1], side)
        cols, col_weights = position_taps(hw[:, 1], grid[2], side)
        index = (rows[:, :, None] * side + cols[:, None, :]).flatten(
            1
        )  # [N, 4]: (r0 c0, r0 c1, r1 c0, r1 c1)
        weights = (row_weights[:, :, None] * col_weights[:, None, :]).flatten(1)
        table = self.w["pos_embed.weight"]
        return (table[index.to(self.device)] * weights.to(self.device, table.dtype)[:, :, None]).sum(1)

    def _rotary(self, hw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [N, head_dim] of each patch's (row, column)."""
        angles = hw[..., None].float() * self.inv_freq  # [N, 2, head_dim / 4]
        angles = torch.cat([angles[:, 0], angles[:, 1]], dim=-1)
        angles = torch.cat([angles, angles], dim=-1).to(self.device)
        return angles.cos(), angles.sin()

    def _attention(self, x, name: str, rotary, frames: list[int]) -> torch.Tensor:
        cfg, num = self.config, x.shape[0]
        q, k, v = self._linear(x, name + ".qkv").view(num, 3, cfg.num_heads, cfg.head_dim).unbind(1)
        cos, sin = (t.unsqueeze(1) for t in rotary)

        def rotate(y):  # in float32, as transformers' apply_rotary_pos_emb_vision
            y = y.float()
            half = y.shape[-1] // 2
            return (y * cos + torch.cat([-y[..., half:], y[..., :half]], dim=-1) * sin).to(x.dtype)

        q, k = rotate(q), rotate(k)
        out = [
            F.scaled_dot_product_attention(*(t.transpose(0, 1) for t in part), scale=cfg.head_dim**-0.5)
            for part in zip(*(t.split(frames) for t in (q, k, v)))
        ]  # [heads, h * w, head_dim] each: a temporal patch attends within itself only
        attended = torch.cat([o.transpose(0, 1) for o in out]).reshape(num, -1)
        return self._linear(attended, name + ".proj")

    def _mlp(self, x: torch.Tensor, name: str) -> torch.Tensor:
        approximate = "tanh" if self.config.hidden_act == "gelu_pytorch_tanh" else "none"
        return self._linear(
            F.gelu(self._linear(x, name + ".linear_fc1"), approximate=approximate), name + ".linear_fc2"
        )

    def _merge(self, x: torch.Tensor, name: str, after_shuffle: bool) -> torch.Tensor:
        """[N, hidden] -> [N / merge^2, text hidden]: each merge block's patches side by side, normed
        before (the merger) or after (a deepstack merger) they are put together."""
        width = x.shape[-1] * self.config.spatial_merge_size**2
        x = (
            self._norm(x.reshape(-1, width), name + ".norm")
            if after_shuffle
            else self._norm(x, name + ".norm")
        )
        x = x.reshape(-1, width)
        return self._linear(F.gelu(self._linear(x, name + ".linear_fc1")), name + ".linear_fc2")

    def features(self, patches, grid: tuple[int, int, int]) -> torch.Tensor:
        """[tokens, text hidden * (1 + num_deepstack)]: the merged features, then each deepstack
        merger's, side by side, as the engine's embedding takes them (tpserve/ranks/layers/vocab.py VocabEmbedding)."""
        features, deepstack = self.features_and_deepstack(patches, grid)
        return torch.cat([features, *deepstack], dim=1)

    def features_and_deepstack(self, patches, grid) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        cfg = self.config
        patches = torch.as_tensor(patches).to(self.device, self.dtype)
        if patches.shape != (grid[0] * grid[1] * grid[2], cfg.patch_values):
            raise ValueError(f"patches of shape {list(patches.shape)} for grid {list(grid)}")
        with torch.inference_mode():
            kernel = (cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size)
            x = patches.view(-1, cfg.in_channels, *kernel)
            embed = F.conv3d(
                x, self.w["patch_embed.proj.weight"], self.w["patch_embed.proj.bias"], stride=kernel
            )
            hw = hw_positions(grid, cfg.spatial_merge_size)  # [N, 2], merge blocks first
            h = embed.view(-1, cfg.hidden_size) + self._positions(hw, grid)
            rotary = self._rotary(hw)
            frames = [grid[1] * grid[2]] * grid[0]
            deepstack = []
            for index in range(cfg.depth):
                p = f"blocks.{index}."
                h = h + self._attention(self._norm(h, p + "norm1"), p + "attn", rotary, frames)
                h = h + self._mlp(self._norm(h, p + "norm2"), p + "mlp")
                if index in cfg.deepstack_visual_indexes:
                    merger = cfg.deepstack_visual_indexes.index(index)
                    deepstack.append(self._merge(h, f"deepstack_merger_list.{merger}", after_shuffle=True))
            return self._merge(h, "merger", after_shuffle=False), tuple(deepstack)


def tower_names(config: Qwen3VisionConfig) -> list[str]:
    leaves = ("weight", "bias")
    names = [f"patch_embed.proj.{leaf}" for leaf in leaves] + ["pos_embed.weight"]
    mergers = ["merger"] + [f"deepstack_merger_list.{i}" for i in range(len(config.deepstack_visual_indexes))]
    for merger in mergers:
        names += [
            f"{merger}.{part}.{leaf}" for part in ("norm", "linear_fc1", "linear_fc2") for leaf in leaves
        ]
    for index in range(config.depth):
        parts = ("norm1", "norm2", "attn.qkv", "attn.proj", "mlp.linear_fc1", "mlp.linear_fc2")
        names += [f"blocks.{index}.{part}.{leaf}" for part in parts for leaf in leaves]
    return names


def load_qwen3_vision_tower(
    model_dir: str | Path, config: Qwen3VisionConfig, dtype: torch.dtype, device="cpu"
) -> Qwen3VisionTower:
    """The tower, merger and deepstack mergers of a Qwen3-VL checkpoint (`model.visual.*`), whole, on one rank."""
    model_dir = Path(model_dir)
    tensors = read_visual_tensors(model_dir, tower_names(config), dtype, device)
    check_patch_embed(model_dir, config, tensors)
    if tuple(tensors["pos_embed.weight"].shape) != (config.num_position_embeddings, config.hidden_size):
        raise ModelFileError(
            model_dir, "visual.pos_embed.weight is not num_position_embeddings x hidden_size"
        )
    return Qwen3VisionTower(config, tensors)
