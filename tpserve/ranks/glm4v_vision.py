"""A GLM-4.1V model's vision tower: the patch embedding over temporal patches and its RMSNorm, a learned
position table resampled to each grid (bicubic, as transformers' grid_sample), the ViT (full attention
within each temporal patch, RMSNorms, a SwiGLU MLP) with Qwen3-VL's 2-D rotary, the post-norm, the
downsample conv over each 2x2 merge block and the GLU merger, in plain torch.

Its output is one row per text position, in the processor's order (merge blocks first). It runs on rank
0 only, one image at a time, as the Qwen-VL towers do (tpserve/ranks/qwen3_vision.py, whose rotary and
attention it shares): its features reach every rank through the embedding's all-reduce.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from tpserve.ranks.errors import ModelFileError
from tpserve.ranks.glm4v_vision_config import Glm4vVisionConfig
from tpserve.ranks.qwen3_vision import Qwen3VisionTower
from tpserve.ranks.qwen_vision import check_patch_embed, hw_positions, read_visual_tensors

MERGER_NORM_EPS = 1e-5  # the merger's LayerNorm takes torch's default


class Glm4vVisionTower(Qwen3VisionTower):
    """patches [N, C*T*P*P] of one grid (t, h, w) -> features [N / merge^2, text hidden]."""

    def __init__(self, config: Glm4vVisionConfig, tensors: dict[str, torch.Tensor]):
        super().__init__(config, tensors)

    def _linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return F.linear(x, self.w[name + ".weight"], self.w.get(name + ".bias"))

    def _norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        """RMSNorm as transformers' Glm4vRMSNorm: in float32, rounded, then scaled."""
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.config.rms_norm_eps)
        return self.w[name + ".weight"] * normed.to(x.dtype)

    def _mlp(self, x: torch.Tensor, name: str) -> torch.Tensor:
        gate = F.silu(self._linear(x, name + ".gate_proj"))
        return self._linear(gate * self._linear(x, name + ".up_proj"), name + ".down_proj")

    def _positions(self, hw: torch.Tensor, grid) -> torch.Tensor:
        """The learned table resampled to the grid at each patch's (row, column) hw [N, 2]: [N, hidden].
        Bicubic, corners not aligned, the border repeated: transformers' grid_sample, in float32."""
        table = self.w["embeddings.position_embedding.weight"]
        side, hidden = self.config.position_side, table.shape[1]
        image = (
            table.view(side, side, hidden).permute(2, 0, 1).unsqueeze(0).float()
        )  # [1, hidden, side, side]
        hw = hw.to(self.device, torch.float32)
        rows = (hw[:, 0] + 0.5) / grid[1] * 2 - 1
        cols = (hw[:, 1] + 0.5) / grid[2] * 2 - 1
        points = torch.stack((cols, rows), dim=-1)[None, :, None]  # [1, N, 1, 2]: (x, y)
        sampled = F.grid_sample(image, points, mode="bicubic", align_corners=False, padding_mode="border")
        return sampled[0, :, :, 0].T.to(table.dtype)  # [N, hidden]

    def features(self, patches, grid: tuple[int, int, int]) -> torch.Tensor:
        cfg = self.config
        patches = torch.as_tensor(patches).to(self.device, self.dtype)
        if patches.shape != (grid[0] * grid[1] * grid[2], cfg.patch_values):
            raise ValueError(f"patches of shape {list(patches.shape)} for grid {list(grid)}")
        merge = cfg.spatial_merge_size
        with torch.inference_mode():
            kernel = (cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size)
            x = patches.view(-1, cfg.in_channels, *kernel)
            embed = F.conv3d(
                x, self.w["patch_embed.proj.weight"], self.w["patch_embed.proj.bias"], stride=kernel
            )
            h = self._norm(embed.view(-1, cfg.hidden_size), "post_conv_layernorm")
            hw = hw_positions(grid, merge)  # [N, 2], merge blocks first
            h = h + self._positions(hw, grid)
            rotary = self._rotary(hw)
            frames = [grid[1] * grid[2]] * grid[0]
            for index in range(cfg.depth):
                p = f"blocks.{index}."
                h = h + self._attention(self._norm(h, p + "norm1"), p + "attn", rotary, frames)
                h = h + self._mlp(self._norm(h, p + "norm2"), p + "mlp")
            h = self._norm(h, "post_layernorm").view(-1, merge, merge, cfg.hidden_size).permute(0, 3, 1, 2)
            h = F.conv2d(h, self.w["downsample.weight"], self.w["downsample.bias"], stride=merge)
            h = self._linear(h.view(-1, cfg.out_hidden_size), "merger.proj")
            names = ("merger.post_projection_norm.weight", "merger.post_projection_norm.bias")
            h = F.gelu(F.layer_norm(h, h.shape[-1:], *(self.w[n] for n in names), MERGER_NORM_EPS))
            return self._mlp(h, "merger")  # [tokens, text hidden]


def tower_names(config: Glm4vVisionConfig) -> list[str]:
    names = ["patch_embed.proj.weight", "patch_embed.proj.bias", "post_conv_layernorm.weight"]
    names += ["embeddings.position_embedding.weight", "post_layernorm.weight"]
    names += ["downsample.weight", "downsample.bias", "merger.proj.weight"]
    names += ["merger.post_projection_norm.weight", "merger.post_projection_norm.bias"]
    names += [f"merger.{part}.weight" for part in ("gate_proj", "up_proj", "down_proj")]
    for index in range(config.depth):
        p = f"blocks.{index}."
        names += [p + "norm1.weight", p + "norm2.weight", p + "attn.qkv.weight", p + "attn.proj.weight"]
        names += [p + "attn.qkv.bias"] if config.attention_bias else []
        names += [f"{p}mlp.{part}.weight" for part in ("gate_proj", "up_proj", "down_proj")]
    return names


def load_glm4v_vision_tower(
    model_dir: str | Path, config: Glm4vVisionConfig, dtype: torch.dtype, device="cpu"
) -> Glm4vVisionTower:
    """The tower, downsample and merger of a GLM-4.1V checkpoint (`model.visual.*`), whole, on one rank."""
    model_dir = Path(model_dir)
    tensors = read_visual_tensors(model_dir, tower_names(config), dtype, device)
    check_patch_embed(model_dir, config, tensors)
    table = (config.position_side**2, config.hidden_size)
    if tuple(tensors["embeddings.position_embedding.weight"].shape) != table:
        raise ModelFileError(
            model_dir,
            f"visual.embeddings.position_embedding.weight is not {list(table)} (image_size/patch_size squared)",
        )
    merge = config.spatial_merge_size
    downsample = (config.out_hidden_size, config.hidden_size, merge, merge)
    if tuple(tensors["downsample.weight"].shape) != downsample:
        raise ModelFileError(model_dir, f"visual.downsample.weight is not {list(downsample)}")
    return Glm4vVisionTower(config, tensors)
