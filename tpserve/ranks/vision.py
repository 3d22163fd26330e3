"""A LLaVA model's vision side: the CLIP vision tower and the multimodal projector, in plain torch.

It runs on rank 0 only, one image at a time (a fixed shape, so an image's features never depend on
what else is being read). Its features go into rank 0's share of the prompt embeddings at the image
positions, and the embedding's all-reduce carries them to every rank (tpserve/ranks/model.py): the followers
hold no vision weights and receive no pixels.
"""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open

from tpserve.ranks.errors import ModelFileError
from tpserve.ranks.vision_config import VisionConfig
from tpserve.ranks.weights import checkpoint_files

TOWER_PREFIXES = (
    "vision_tower.vision_model.",
    "model.vision_tower.vision_model.",
    "vision_tower.",
    "model.vision_tower.",
)
PROJECTOR_PREFIXES = ("multi_modal_projector.", "model.multi_modal_projector.")


def _activation(name: str, x: torch.Tensor) -> torch.Tensor:
    if name == "quick_gelu":
        return x * torch.sigmoid(1.702 * x)
    if name == "gelu_pytorch_tanh":  # SigLIP's (tpserve/ranks/siglip_vision.py)
        return F.gelu(x, approximate="tanh")
    return F.gelu(x)  # the exact (erf) form, as transformers' "gelu"


class VisionTower:
    """pixels [3, H, W] -> image features [tokens_per_image, text hidden] (the projector's output).

    Its encoder layer (pre-norm attention and MLP, q/k/v/out_proj, fc1/fc2) is SigLIP's too: the
    Idefics3 tower (tpserve/ranks/siglip_vision.py) is this class with its own embedding and connector.
    """

    def __init__(self, config: VisionConfig, tensors: dict[str, torch.Tensor]):
        self.config = config
        self.w = tensors  # names without their checkpoint prefix: "embeddings.*", "encoder.*", "linear_1.*"
        self.dtype = tensors["embeddings.patch_embedding.weight"].dtype
        self.device = tensors["embeddings.patch_embedding.weight"].device

    def _norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return F.layer_norm(
            x, x.shape[-1:], self.w[name + ".weight"], self.w[name + ".bias"], self.config.layer_norm_eps
        )

    def _linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return F.linear(x, self.w[name + ".weight"], self.w.get(name + ".bias"))

    def _embed(self, pixels: torch.Tensor) -> torch.Tensor:
        cfg, w = self.config, self.w
        patches = F.conv2d(pixels.unsqueeze(0), w["embeddings.patch_embedding.weight"], stride=cfg.patch_size)
        patches = patches.flatten(2).transpose(1, 2)[0]  # [num_patches, C]
        h = torch.cat([w["embeddings.class_embedding"].unsqueeze(0), patches])  # [1 + num_patches, C]
        return h + w["embeddings.position_embedding.weight"]

    def _layer(self, h: torch.Tensor, index: int) -> torch.Tensor:
        cfg, p = self.config, f"encoder.layers.{index}."
        x = self._norm(h, p + "layer_norm1")
        num_tokens, head_dim = x.shape[0], cfg.hidden_size // cfg.num_heads
        q, k, v = (
            self._linear(x, p + f"self_attn.{n}_proj")
            .view(num_tokens, cfg.num_heads, head_dim)
            .transpose(0, 1)
            for n in "qkv"
        )  # [heads, tokens, head_dim] each
        attended = F.scaled_dot_product_attention(q, k, v, scale=head_dim**-0.5)
        h = h + self._linear(attended.transpose(0, 1).reshape(num_tokens, -1), p + "self_attn.out_proj")
        x = self._norm(h, p + "layer_norm2")
        return h + self._linear(_activation(cfg.hidden_act, self._linear(x, p + "mlp.fc1")), p + "mlp.fc2")

    def features(self, pixels) -> torch.Tensor:
        """pixels: [3, H, W] float32, a tensor or a numpy array (the server prepares numpy)."""
        cfg = self.config
        pixels = torch.as_tensor(pixels)
        with torch.inference_mode():
            h = self._norm(self._embed(pixels.to(self.device, self.dtype)), "pre_layrnorm")
            hidden = [h]  # hidden[i]: the input of encoder layer i (transformers' hidden_states)
            for index in range(cfg.layers_needed):
                h = self._layer(h, index)
                hidden.append(h)
            taken = [hidden[layer] for layer in cfg.feature_layers]
            if cfg.select_strategy == "default":
                taken = [state[1:] for state in taken]  # the CLS position is no image token
            x = self._linear(torch.cat(taken, dim=-1), "linear_1")
            return self._linear(_activation(cfg.projector_act, x), "linear_2")  # [tokens, text hidden]


def tower_names(config: VisionConfig) -> list[str]:
    names = [
        "embeddings.patch_embedding.weight",
        "embeddings.class_embedding",
        "embeddings.position_embedding.weight",
        "pre_layrnorm.weight",
        "pre_layrnorm.bias",
    ]
    return names + encoder_names(config.layers_needed)


def encoder_names(num_layers: int) -> list[str]:
    """The tensors of a CLIP or SigLIP encoder's first num_layers layers."""
    names = []
    for index in range(num_layers):
        p = f"encoder.layers.{index}."
        for leaf in (
            "layer_norm1",
            "layer_norm2",
            *(f"self_attn.{n}_proj" for n in "qkv"),
            "self_attn.out_proj",
            "mlp.fc1",
            "mlp.fc2",
        ):
            names += [p + leaf + ".weight", p + leaf + ".bias"]
    return names


def projector_names(config: VisionConfig) -> list[str]:
    leaves = (".weight", ".bias") if config.projector_bias else (".weight",)
    return [layer + leaf for layer in ("linear_1", "linear_2") for leaf in leaves]


def load_vision_tower(
    model_dir: str | Path, config: VisionConfig, dtype: torch.dtype, device="cpu"
) -> VisionTower:
    """The tower and projector of a LLaVA checkpoint (transformers 4 or 5 naming), whole, on one rank."""
    model_dir = Path(model_dir)
    wanted = [(name, TOWER_PREFIXES) for name in tower_names(config)]
    wanted += [(name, PROJECTOR_PREFIXES) for name in projector_names(config)]
    tensors = read_tensors(model_dir, wanted, dtype, device)
    expected = (config.num_patches + 1, config.hidden_size)
    if tuple(tensors["embeddings.position_embedding.weight"].shape) != expected:
        raise ModelFileError(
            model_dir, f"vision position embeddings are not {list(expected)} (image_size/patch_size)"
        )
    return VisionTower(config, tensors)


def read_tensors(
    model_dir: Path, wanted: list[tuple[str, tuple[str, ...]]], dtype: torch.dtype, device
) -> dict[str, torch.Tensor]:
    """Each (name, prefixes) of `wanted` read whole from the checkpoint, stored under the first of
    its prefixes that holds it, keyed by its name without the prefix."""
    files = checkpoint_files(model_dir)
    tensors = {}
    with ExitStack() as stack:
        handles = {
            path: stack.enter_context(safe_open(str(path), framework="pt"))
            for path in sorted(set(files.values()))
        }
        for name, prefixes in wanted:
            stored = next((prefix + name for prefix in prefixes if prefix + name in files), None)
            if stored is None:
                raise ModelFileError(
                    model_dir, f"checkpoint has no vision tensor {name!r} (under {prefixes[0]!r})"
                )
            tensors[name] = handles[files[stored]].get_tensor(stored).to(device=device, dtype=dtype)
    return tensors
