"""An Idefics3 or SmolVLM model's vision side: the SigLIP tower over one tile (its patch embedding, a
learned position table looked up by bucketed patch positions, pre-norm encoder layers, the post
layernorm), then the connector (a pixel shuffle of scale_factor and the linear modality projection),
in plain torch.

It runs on rank 0 only, one tile at a time (a fixed shape, so a tile's features never depend on what
else is being read), as the LLaVA tower does (tpserve/ranks/vision.py, whose encoder layer this is):
its features reach every rank through the embedding's all-reduce. Every tile the processor makes is
image_size square, so transformers' patch attention mask over a tile is all ones: nothing is masked.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from tpserve.ranks.errors import ModelFileError
from tpserve.ranks.idefics3_config import Idefics3VisionConfig
from tpserve.ranks.vision import VisionTower, encoder_names, read_tensors

TOWER_PREFIXES = ("model.vision_model.",)
CONNECTOR_PREFIXES = ("model.connector.",)


def bucketed_positions(num_rows: int, num_cols: int, side: int) -> torch.Tensor:
    """The position-table row [rows * cols] of each patch of a rows x cols grid: its fractional place
    bucketed into the table's side x side grid, in float32 as transformers' Idefics3VisionEmbeddings
    (a grid of the table's own size maps to 0, 1, 2, ...)."""
    boundaries = torch.arange(1 / side, 1.0, 1 / side)

    def buckets(count: int) -> torch.Tensor:
        fractions = torch.arange(count, dtype=torch.float32) * (1.0 / torch.tensor(count))
        return torch.bucketize(fractions.clamp(max=1.0 - 1e-6), boundaries, right=True)

    return (buckets(num_rows)[:, None] * side + buckets(num_cols)[None, :]).flatten()


def pixel_shuffle(x: torch.Tensor, scale: int) -> torch.Tensor:
    """[side * side, C] -> [(side / scale)^2, C * scale^2]: each scale x scale block of patches side by
    side in one row, in transformers' Idefics3Connector order."""
    seq, width = x.shape
    side = int(seq**0.5)
    x = x.view(side, side // scale, width * scale).permute(1, 0, 2)
    x = x.reshape(side // scale, side // scale, width * scale * scale).permute(1, 0, 2)
    return x.reshape(seq // scale**2, width * scale**2)


class SiglipVisionTower(VisionTower):
    """tiles [N, 3, image_size, image_size] -> features [N * image_seq_len, text hidden]. Gemma 3's
    tower (tpserve/ranks/gemma3_vision.py) is this one with its own connector."""

    config: Idefics3VisionConfig

    def __init__(self, config: Idefics3VisionConfig, tensors: dict[str, torch.Tensor]):
        super().__init__(config, tensors)
        side = config.patches_per_side
        self.positions = bucketed_positions(side, side, side).to(self.device)

    def _tile(self, pixels: torch.Tensor) -> torch.Tensor:
        """One tile [3, S, S] -> its image tokens [image_seq_len, text hidden]."""
        return self._connect(self._encode(pixels))

    def _connect(self, h: torch.Tensor) -> torch.Tensor:
        """The tower's output [patches, hidden] -> image tokens: the pixel shuffle and projection."""
        return self._linear(pixel_shuffle(h, self.config.scale_factor), "modality_projection.proj")

    def _encode(self, pixels: torch.Tensor) -> torch.Tensor:
        """One tile [3, S, S] -> the tower's last hidden state [patches, hidden], post-layernormed."""
        cfg, w = self.config, self.w
        patches = F.conv2d(
            pixels.unsqueeze(0),
            w["embeddings.patch_embedding.weight"],
            w["embeddings.patch_embedding.bias"],
            stride=cfg.patch_size,
        )
        h = patches.flatten(2).transpose(1, 2)[0]  # [patches, hidden], row by row
        h = h + w["embeddings.position_embedding.weight"][self.positions]
        for index in range(cfg.num_layers):
            h = self._layer(h, index)
        return self._norm(h, "post_layernorm")

    def features(self, tiles) -> torch.Tensor:
        """tiles: float32 [N, 3, S, S], a tensor or a numpy array (the server prepares numpy)."""
        cfg = self.config
        tiles = torch.as_tensor(tiles)
        expected = (cfg.num_channels, cfg.image_size, cfg.image_size)
        if tiles.dim() != 4 or tuple(tiles.shape[1:]) != expected:
            raise ValueError(f"tiles of shape {list(tiles.shape)}, not [N, {', '.join(map(str, expected))}]")
        with torch.inference_mode():
            tiles = tiles.to(self.device, self.dtype)
            return torch.cat([self._tile(tile) for tile in tiles])


def tower_names(config: Idefics3VisionConfig) -> list[str]:
    embeddings = ("patch_embedding.weight", "patch_embedding.bias", "position_embedding.weight")
    names = [f"embeddings.{leaf}" for leaf in embeddings] + encoder_names(config.num_layers)
    return names + ["post_layernorm.weight", "post_layernorm.bias"]


def load_siglip_vision_tower(
    model_dir: str | Path, config: Idefics3VisionConfig, dtype: torch.dtype, device="cpu"
) -> SiglipVisionTower:
    """The tower and connector of an Idefics3 or SmolVLM checkpoint (`model.vision_model.*`,
    `model.connector.*`), whole, on one rank."""
    model_dir = Path(model_dir)
    wanted = [(name, TOWER_PREFIXES) for name in tower_names(config)]
    wanted.append(("modality_projection.proj.weight", CONNECTOR_PREFIXES))
    tensors = read_tensors(model_dir, wanted, dtype, device)
    shapes = {
        "embeddings.position_embedding.weight": (config.patches_per_side**2, config.hidden_size),
        "modality_projection.proj.weight": (
            config.text_hidden_size,
            config.hidden_size * config.scale_factor**2,
        ),
    }
    for name, shape in shapes.items():
        if tuple(tensors[name].shape) != shape:
            raise ModelFileError(model_dir, f"{name} is not {list(shape)} (the config's sizes)")
    return SiglipVisionTower(config, tensors)
