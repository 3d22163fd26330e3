"""A Qwen2.5-VL model's vision tower: the patch embedding over temporal patches, the windowed ViT
(full attention at fullatt_block_indexes, within each temporal patch), its 2-D rotary and the 2x2 patch merger, in plain torch.

It runs on rank 0 only, one image at a time, as the LLaVA tower does (tpserve/ranks/vision.py): its
features reach the other ranks through the embedding's all-reduce. The input is the processor's
flattened patches (tpserve/server/qwen_images.py), laid out in 2x2 merge blocks; the ViT reads them in
window order (windows of window_size pixels, whole merge blocks each) and the merger's output is put
back in the processor's order, one row per text position.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from tpserve.ranks.errors import ModelFileError
from tpserve.ranks.qwen_vision_config import QwenVisionConfig
from tpserve.ranks.vision import read_tensors

PREFIXES = ("visual.", "model.visual.")
NORM_EPS = 1e-6  # transformers' Qwen2.5-VL vision RMSNorms take no eps from the config


def hw_positions(grid: tuple[int, int, int], merge: int) -> torch.Tensor:
    """Each patch's (row, column) in the processor's order (merge blocks, then within): [N, 2]."""
    t, h, w = grid
    rows = torch.arange(h).view(h, 1).expand(h, w)
    cols = torch.arange(w).view(1, w).expand(h, w)
    shape = (h // merge, merge, w // merge, merge)
    rows, cols = (x.reshape(shape).transpose(1, 2).flatten() for x in (rows, cols))
    return torch.stack([rows, cols], dim=-1).repeat(t, 1)


def window_order(grid: tuple[int, int, int], merge: int, window: int) -> tuple[torch.Tensor, list[int]]:
    """The merge blocks in window order (an index into the processor's blocks) and each window's
    size in patches. A window is `window` merge blocks square; the last row and column of windows
    may be cut short by the image's edge."""
    t, h, w = grid
    bh, bw = h // merge, w // merge
    index = torch.arange(t * bh * bw).view(t, bh, bw)
    pad_h, pad_w = -bh % window, -bw % window
    padded = F.pad(index, (0, pad_w, 0, pad_h), value=-1)
    nh, nw = (bh + pad_h) // window, (bw + pad_w) // window
    padded = padded.view(t, nh, window, nw, window).permute(0, 1, 3, 2, 4).reshape(t * nh * nw, -1)
    order, sizes = [], []
    for cells in padded:
        kept = cells[cells >= 0]
        if kept.numel():
            order.append(kept)
            sizes.append(kept.numel() * merge * merge)
    return torch.cat(order), sizes


class QwenVisionTower:
    """patches [N, C*T*P*P] of one image's grid (t, h, w) -> features [N / merge^2, text hidden]."""

    def __init__(self, config: QwenVisionConfig, tensors: dict[str, torch.Tensor]):
        self.config = config
        self.w = tensors  # names without their checkpoint prefix: "patch_embed.*", "blocks.*", "merger.*"
        self.dtype = tensors["patch_embed.proj.weight"].dtype
        self.device = tensors["patch_embed.proj.weight"].device
        quarter = config.head_dim // 2  # h and w rotate a quarter of the head each, twice over
        self.inv_freq = 1.0 / (
            config.rope_theta ** (torch.arange(0, quarter, 2, dtype=torch.float) / quarter)
        )

    def _norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + NORM_EPS)
        return self.w[name + ".weight"] * normed.to(x.dtype)

    def _linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return F.linear(x, self.w[name + ".weight"], self.w.get(name + ".bias"))

    def _rotary(self, grid, order: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [N, head_dim] of each patch's (row, column), in window order."""
        merge = self.config.spatial_merge_size
        angles = hw_positions(grid, merge)[..., None].float() * self.inv_freq  # [N, 2, head_dim / 4]
        angles = torch.cat([angles[:, 0], angles[:, 1]], dim=-1)
        angles = torch.cat([angles, angles], dim=-1)
        unit = merge * merge
        angles = angles.view(-1, unit, angles.shape[-1])[order].flatten(0, 1).to(self.device)
        return angles.cos(), angles.sin()

    def _attention(self, x, name: str, rotary, windows: list[int]) -> torch.Tensor:
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
            for part in zip(*(t.split(windows) for t in (q, k, v)))
        ]  # [heads, window, head_dim] each: a window attends within itself only
        attended = torch.cat([o.transpose(0, 1) for o in out]).reshape(num, -1)
        return self._linear(attended, name + ".proj")

    def _mlp(self, x: torch.Tensor, name: str) -> torch.Tensor:
        act = F.silu if self.config.hidden_act == "silu" else F.gelu
        gate = act(self._linear(x, name + ".gate_proj"))
        return self._linear(gate * self._linear(x, name + ".up_proj"), name + ".down_proj")

    def features(self, patches, grid: tuple[int, int, int]) -> torch.Tensor:
        cfg = self.config
        patches = torch.as_tensor(patches).to(self.device, self.dtype)
        merge, unit = cfg.spatial_merge_size, cfg.spatial_merge_size**2
        if patches.shape != (grid[0] * grid[1] * grid[2], cfg.patch_values):
            raise ValueError(f"patches of shape {list(patches.shape)} for grid {list(grid)}")
        with torch.inference_mode():
            kernel = (cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size)
            x = patches.view(-1, cfg.in_channels, *kernel)
            h = F.conv3d(x, self.w["patch_embed.proj.weight"], stride=kernel).view(-1, cfg.hidden_size)
            order, windows = window_order(grid, merge, cfg.window_size // merge // cfg.patch_size)
            h = h.view(-1, unit, cfg.hidden_size)[order].flatten(0, 1)
            rotary = self._rotary(grid, order)
            whole = [grid[1] * grid[2]] * grid[0]  # "full" attention: within each temporal patch
            for index in range(cfg.depth):
                p = f"blocks.{index}."
                span = whole if index in cfg.fullatt_block_indexes else windows
                h = h + self._attention(self._norm(h, p + "norm1"), p + "attn", rotary, span)
                h = h + self._mlp(self._norm(h, p + "norm2"), p + "mlp")
            x = self._norm(h, "merger.ln_q").view(-1, unit * cfg.hidden_size)
            x = self._linear(F.gelu(self._linear(x, "merger.mlp.0")), "merger.mlp.2")
            return x[torch.argsort(order)]  # back to the processor's order: [tokens, text hidden]


def tower_names(config: QwenVisionConfig) -> list[str]:
    names = ["patch_embed.proj.weight", "merger.ln_q.weight"]
    names += [f"merger.mlp.{i}.{leaf}" for i in (0, 2) for leaf in ("weight", "bias")]
    for index in range(config.depth):
        p = f"blocks.{index}."
        names += [p + "norm1.weight", p + "norm2.weight"]
        for leaf in ("attn.qkv", "attn.proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"):
            names += [p + leaf + ".weight", p + leaf + ".bias"]
    return names


def read_visual_tensors(
    model_dir: Path, names: list[str], dtype: torch.dtype, device
) -> dict[str, torch.Tensor]:
    """The tensors `names` of a Qwen-VL checkpoint's tower, stored under `visual.` or `model.visual.`."""
    return read_tensors(model_dir, [(name, PREFIXES) for name in names], dtype, device)


def load_qwen_vision_tower(
    model_dir: str | Path, config: QwenVisionConfig, dtype: torch.dtype, device="cpu"
) -> QwenVisionTower:
    """The tower and merger of a Qwen2.5-VL checkpoint (`visual.*` or `model.visual.*`), whole, on one rank."""
    model_dir = Path(model_dir)
    tensors = read_visual_tensors(model_dir, tower_names(config), dtype, device)
    check_patch_embed(model_dir, config, tensors)
    return QwenVisionTower(config, tensors)


def check_patch_embed(model_dir: Path, config, tensors: dict[str, torch.Tensor]) -> None:
    """Refuses a tower whose patch embedding is not the config's (a Qwen2.5-VL or Qwen3-VL one)."""
    embed = (
        config.hidden_size,
        config.in_channels,
        config.temporal_patch_size,
        config.patch_size,
        config.patch_size,
    )
    if tuple(tensors["patch_embed.proj.weight"].shape) != embed:
        raise ModelFileError(model_dir, f"visual.patch_embed.proj.weight is not {list(embed)}")
