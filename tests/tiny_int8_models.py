"""Tiny compressed-tensors int8 checkpoints, written from the format's spec (as llm-compressor saves them).

A float tiny model (tiny_models.py) quantized per output channel (scale = absmax / 127, values
rounded and clamped to [-127, 127]) and stored as compressed-tensors does:
- "int-quantized" (W8A8): `X.weight` int8 [out, in] and `X.weight_scale` [out, 1];
- "pack-quantized" (W8A16, 8 bits): `X.weight_packed` int32 [out, ceil(in / 4)], value i of each
  int32 in bits 8i..8i+7 as value + 128, `X.weight_shape` int32 [2], and `X.weight_scale`.
Modules in `ignore` stay float. `float_twin` writes the dequantized weights as a float checkpoint:
the reference the int8 model's logits are compared with.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

FORMATS = ("int-quantized", "pack-quantized")
MODEL_FILES = ("tokenizer.json", "tokenizer_config.json")


def weight_scheme(**overrides) -> dict:
    return {
        "num_bits": 8,
        "type": "int",
        "symmetric": True,
        "strategy": "channel",
        "dynamic": False,
    } | overrides


def quantization_config(fmt: str = "int-quantized", ignore=("lm_head",), **weight_overrides) -> dict:
    inputs = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True}
    return {
        "quant_method": "compressed-tensors",
        "format": fmt,
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": weight_scheme(**weight_overrides),
                "input_activations": inputs if fmt == "int-quantized" else None,
                "output_activations": None,
            }
        },
        "ignore": list(ignore),
        "kv_cache_scheme": None,
        "sparsity_config": {},
    }


def quantize_per_channel(
    weight: torch.Tensor, scale_dtype=torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """(values int8 [out, in], scale [out, 1] in scale_dtype), weight ~ values * scale."""
    scale = (weight.abs().amax(dim=1, keepdim=True) / 127).to(scale_dtype)
    values = (weight / scale.float()).round().clamp(-127, 127).to(torch.int8)
    return values, scale


def pack_int32(values: torch.Tensor) -> torch.Tensor:
    # values: [out, in] int8 -> [out, ceil(in / 4)] int32, as compressed-tensors' pack_to_int32(8 bits)
    unsigned = (values.to(torch.int32) + 128).to(torch.int64)
    unsigned = torch.nn.functional.pad(unsigned, (0, -values.shape[1] % 4))
    groups = unsigned.view(values.shape[0], -1, 4)
    packed = sum(groups[..., i] << (8 * i) for i in range(4))
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def is_quantizable(name: str) -> bool:
    return name.endswith("_proj.weight") or name == "lm_head.weight"


def write_int8_checkpoint(
    float_dir: str | Path,
    out_dir: str | Path,
    fmt: str = "int-quantized",
    ignore=("lm_head",),
    scale_dtype=torch.float32,
    tensors: dict[str, torch.Tensor] | None = None,
    quantizable=is_quantizable,
) -> Path:
    """`float_dir`'s model in compressed-tensors int8 (format `fmt`) at `out_dir`, the weights
    `quantizable` names (but those in `ignore`) quantized; `tensors` replace or add stored tensors
    afterwards (a corrupt file)."""
    float_dir, out = Path(float_dir), Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for name in MODEL_FILES:
        shutil.copy(float_dir / name, out / name)
    config = json.loads((float_dir / "config.json").read_text())
    config["quantization_config"] = quantization_config(fmt, ignore)
    (out / "config.json").write_text(json.dumps(config, indent=1))
    stored = {}
    for name, weight in load_file(float_dir / "model.safetensors").items():
        module = name.removesuffix(".weight")
        if not quantizable(name) or module in ignore:
            stored[name] = weight
            continue
        values, scale = quantize_per_channel(weight, scale_dtype)
        stored[module + ".weight_scale"] = scale
        if fmt == "pack-quantized":
            stored[module + ".weight_packed"] = pack_int32(values)
            stored[module + ".weight_shape"] = torch.tensor(values.shape, dtype=torch.int32)
        else:
            stored[name] = values
    stored.update(tensors or {})
    save_file(stored, str(out / "model.safetensors"))
    return out


def dequantized(int8_dir: str | Path) -> dict[str, torch.Tensor]:
    """The float32 weights an int8 checkpoint stands for: values * scale, the rest as stored."""
    stored = load_file(Path(int8_dir) / "model.safetensors")
    weights = {}
    for name, tensor in stored.items():
        if name.endswith(("_scale", "_shape")):
            continue
        if name.endswith(".weight_packed"):
            module = name.removesuffix(".weight_packed")
            tensor = unpack_int32(tensor, stored[module + ".weight_shape"].tolist())
            name = module + ".weight"
        scale = stored.get(name + "_scale")
        weights[name] = tensor.float() * scale.float() if scale is not None else tensor
    return weights


def unpack_int32(packed: torch.Tensor, shape: list[int]) -> torch.Tensor:
    unsigned = torch.stack([(packed.to(torch.int64) >> (8 * i)) & 0xFF for i in range(4)], dim=-1)
    return (unsigned.view(packed.shape[0], -1)[:, : shape[1]] - 128).to(torch.int8)


def float_twin(
    int8_dir: str | Path, out_dir: str | Path, weights: dict[str, torch.Tensor] | None = None
) -> Path:
    """The int8 checkpoint's dequantized weights (or `weights`) as a float checkpoint (no
    quantization_config)."""
    int8_dir, out = Path(int8_dir), Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for name in MODEL_FILES:
        shutil.copy(int8_dir / name, out / name)
    config = json.loads((int8_dir / "config.json").read_text())
    del config["quantization_config"]
    (out / "config.json").write_text(json.dumps(config, indent=1))
    save_file(dequantized(int8_dir) if weights is None else weights, str(out / "model.safetensors"))
    return out
