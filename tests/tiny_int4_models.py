"""Tiny compressed-tensors int4 checkpoints, written by the compressed-tensors library as llm-compressor saves them.

A float tiny model (tiny_models.py) is loaded into transformers in the dtype its scales are to have,
its Linear layers (but `ignore`) given a W4A16 QuantizationScheme by apply_quantization_config; each
weight's scale and zero point come from its min and max per group (or row) through the library's
calculate_qparams, as llm-compressor's minmax observer computes them; ModelCompressor then packs the
model (compress_model), save_pretrained writes it and update_config its quantization_config. So the
packing, the tensors' names and the config are the library's own, not our reading of them.
`decompressed` is the library's own decompression of every weight (its compressor's decompress), in
float32; `float_twin` writes those weights as a float checkpoint, the reference the served model is
compared with.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from compressed_tensors.compressors import ModelCompressor
from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
from compressed_tensors.quantization import (
    QuantizationArgs,
    QuantizationConfig,
    QuantizationScheme,
    apply_quantization_config,
)
from compressed_tensors.quantization.utils.helpers import calculate_qparams
from safetensors.torch import load_file, save_file
from tiny_models import write_tiny_model
from transformers import AutoModelForCausalLM

MODEL_FILES = ("tokenizer.json", "tokenizer_config.json")
# Sizes whose every input is whole groups of 128 (the tiny models' hidden size, 96, is not); its
# o_proj's columns split 64 + 64 inside one group.
WIDE = {"hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2}


def weight_args(
    strategy: str = "group", group_size: int | None = 32, symmetric: bool = True
) -> QuantizationArgs:
    return QuantizationArgs(
        num_bits=4,
        type="int",
        strategy=strategy,
        group_size=group_size if strategy == "group" else None,
        symmetric=symmetric,
    )


def write_int4_checkpoint(
    out_dir: str | Path,
    variant: str = "llama",
    *,
    args: QuantizationArgs | None = None,
    dtype: torch.dtype = torch.bfloat16,
    ignore=("lm_head",),
    overrides: dict | None = None,
) -> Path:
    """The tiny `variant` (config `overrides`) quantized to int4 by compressed-tensors with `args`
    (default: symmetric, groups of 32), its scales and float tensors in `dtype`, at `out_dir`."""
    out = Path(out_dir)
    float_dir = write_tiny_model(out.with_name(out.name + "-float"), variant, overrides=overrides)
    model = AutoModelForCausalLM.from_pretrained(float_dir, dtype=dtype)
    scheme = QuantizationScheme(targets=["Linear"], weights=args or weight_args())
    config = QuantizationConfig(config_groups={"group_0": scheme}, ignore=list(ignore))
    apply_quantization_config(model, config, show_progress=False)
    for module in model.modules():
        if getattr(module, "quantization_scheme", None) is not None:
            _observe_min_max(module)
    compressor = ModelCompressor.from_pretrained_model(model, "pack-quantized")
    compressor.compress_model(model)
    model.save_pretrained(out)
    compressor.update_config(out)
    for name in MODEL_FILES:
        shutil.copy(float_dir / name, out / name)
    return out


def _observe_min_max(module: torch.nn.Module) -> None:
    """The weight's scale (and zero point) from its min and max per group or row."""
    args = module.quantization_scheme.weights
    weight = module.weight.data
    if args.strategy == "group":
        weight = weight.unflatten(-1, (-1, args.group_size))  # [out, groups, group_size]
        low, high = weight.amin(dim=-1), weight.amax(dim=-1)
    else:
        low, high = weight.amin(dim=1, keepdim=True), weight.amax(dim=1, keepdim=True)
    scale, zero_point = calculate_qparams(low, high, args)
    module.weight_scale.data.copy_(scale)
    if hasattr(module, "weight_zero_point"):
        module.weight_zero_point.data.copy_(zero_point)


def scheme_of(model_dir: str | Path) -> QuantizationScheme:
    config = json.loads((Path(model_dir) / "config.json").read_text())["quantization_config"]
    return QuantizationConfig.model_validate(config).config_groups["group_0"]


def decompressed(
    model_dir: str | Path, scale_dtype: torch.dtype | None = torch.float32
) -> dict[str, torch.Tensor]:
    """Every weight as compressed-tensors decompresses it, with its scales in `scale_dtype` (float32:
    exact; None: as stored, what the library's own float model holds); the rest as stored, in float32."""
    stored, scheme = load_file(Path(model_dir) / "model.safetensors"), scheme_of(model_dir)
    weights = {}
    for name, tensor in stored.items():
        if not name.endswith(".weight_packed"):
            if not name.endswith(("_scale", "_shape", "_zero_point")):
                weights[name] = tensor.float()
            continue
        module = name.removesuffix("_packed").removesuffix(".weight")
        parts = {
            key: stored[f"{module}.{key}"]
            for key in PackedQuantizationCompressor.compression_param_names(scheme)
        }
        if scale_dtype is not None:
            parts["weight_scale"] = parts["weight_scale"].to(scale_dtype)
        weights[module + ".weight"] = PackedQuantizationCompressor.decompress(parts, scheme)["weight"]
    return weights


def float_twin(int4_dir: str | Path, out_dir: str | Path) -> Path:
    """The int4 checkpoint's decompressed weights (float32, exact) as a float checkpoint."""
    int4_dir, out = Path(int4_dir), Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for name in MODEL_FILES:
        shutil.copy(int4_dir / name, out / name)
    config = json.loads((int4_dir / "config.json").read_text())
    del config["quantization_config"]
    (out / "config.json").write_text(json.dumps(config, indent=1))
    save_file(decompressed(int4_dir), str(out / "model.safetensors"))
    return out
