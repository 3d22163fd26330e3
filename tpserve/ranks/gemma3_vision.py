"""A Gemma 3 model's vision side: the SigLIP tower (tpserve/ranks/siglip_vision.py: the patch
embedding, the position table in patch order, the encoder layers, the post layernorm) over one
image_size square image, then Gemma3MultiModalProjector: an average pool of pool_size x pool_size
patches to mm_tokens_per_image tokens, the (1 + w) RMSNorm in float32, and the projection to the
text model's width.

It runs on rank 0 only, one image at a time (a fixed shape), as every tower does: its features reach
every rank through the embedding's all-reduce (tpserve/ranks/model.py), so tp=2 gives tp=1's bits.
transformers 5 writes the tower under `vision_tower.`, Google's checkpoints under
`vision_tower.vision_model.`; the projector under `multi_modal_projector.` (either with `model.`
before it).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from tpserve.ranks.errors import ModelFileError
from tpserve.ranks.gemma3_vision_config import Gemma3VisionConfig
from tpserve.ranks.siglip_vision import SiglipVisionTower, tower_names
from tpserve.ranks.vision import PROJECTOR_PREFIXES, TOWER_PREFIXES, read_tensors

PROJECTOR_NAMES = ("mm_input_projection_weight", "mm_soft_emb_norm.weight")


class Gemma3VisionTower(SiglipVisionTower):
    """an image [3, image_size, image_size] -> features [tokens_per_image, text hidden]."""

    config: Gemma3VisionConfig

    def features(self, pixels) -> torch.Tensor:
        """pixels: float32 [3, S, S], a tensor or a numpy array (VisionInput.read's, one image)."""
        return super().features(torch.as_tensor(pixels).unsqueeze(0))

    def _connect(self, h: torch.Tensor) -> torch.Tensor:
        """[patches, hidden] (row by row) -> [tokens_per_image, text hidden]."""
        cfg, side = self.config, self.config.patches_per_side
        grid = h.transpose(0, 1).reshape(1, cfg.hidden_size, side, side)
        pooled = F.avg_pool2d(grid, cfg.pool_size).flatten(2)[0].transpose(0, 1)  # [tokens, hidden]
        # Gemma3RMSNorm: normalised and scaled by 1 + w in float32, rounded back once
        x = pooled.float()
        normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg.layer_norm_eps)
        normed = (normed * (1.0 + self.w["mm_soft_emb_norm.weight"].float())).to(pooled.dtype)
        return normed @ self.w["mm_input_projection_weight"]  # [vision hidden, text hidden]


def load_gemma3_vision_tower(
    model_dir: str | Path, config: Gemma3VisionConfig, dtype: torch.dtype, device="cpu"
) -> Gemma3VisionTower:
    """The tower and projector of a Gemma3ForConditionalGeneration checkpoint, whole, on one rank."""
    model_dir = Path(model_dir)
    wanted = [(name, TOWER_PREFIXES) for name in tower_names(config)]
    wanted += [(name, PROJECTOR_PREFIXES) for name in PROJECTOR_NAMES]
    tensors = read_tensors(model_dir, wanted, dtype, device)
    shapes = {
        "embeddings.position_embedding.weight": (config.patches_per_side**2, config.hidden_size),
        "mm_input_projection_weight": (config.hidden_size, config.text_hidden_size),
    }
    for name, shape in shapes.items():
        if tuple(tensors[name].shape) != shape:
            raise ModelFileError(model_dir, f"{name} is not {list(shape)} (the config's sizes)")
    return Gemma3VisionTower(config, tensors)
