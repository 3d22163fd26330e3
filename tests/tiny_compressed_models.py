"""Tiny compressed-tensors int4 and fp8 checkpoints, written by the compressed-tensors library as llm-compressor saves them.

A float tiny model (tiny_models.py) is loaded into transformers in the dtype its scales are to have,
its Linear layers (but `ignore`) given a W4A16 (or FP8) QuantizationScheme by apply_quantization_config; each
weight's scale and zero point come from its min and max per group (or row) through the library's
calculate_qparams, as llm-compressor's minmax observer computes them; ModelCompressor then packs the
model (compress_model, format pack-quantized or float-quantized), save_pretrained writes it and
update_config its quantization_config. So the
packing, the tensors' names and the config are the library's own, not our reading of them.
`decompressed` is the library's own decompression of every weight (its compressor's decompress), in
float32; `float_twin` writes those weights as a float checkpoint, the reference the served model is
compared with.

A mixture of experts (`write_compressed_moe_checkpoint`) cannot go through the modules: transformers
5 holds a layer's experts as one 3D parameter, no Linear for apply_quantization_config to find. Real
checkpoints (llm-compressor's Qwen3-MoE and Mixtral W4A16 examples) store every expert's projection
as its own quantized linear, `mlp.experts.N.gate_proj.weight_packed` (Mixtral's
`block_sparse_moe.experts.N.w1...`), with the router left float by `ignore` ("re:.*mlp.gate$").
So each stored tensor that a linear would hold is quantized alone: its scale and zero point from its
min and max per group through calculate_qparams, packed by the library's PackedQuantizationCompressor,
and the config written by the library's ModelCompressor.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
from compressed_tensors.compressors import ModelCompressor
from compressed_tensors.compressors.naive_quantized.base import NaiveQuantizationCompressor
from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
from compressed_tensors.quantization import (
    QuantizationArgs,
    QuantizationConfig,
    QuantizationScheme,
    apply_quantization_config,
)
from compressed_tensors.quantization.utils.helpers import calculate_qparams
from safetensors.torch import load_file, save_file
from tiny_hf_models import write_hf_model
from tiny_int8_models import MODEL_FILES
from tiny_int8_models import float_twin as float_checkpoint
from tiny_models import write_tiny_model
from transformers import AutoModelForCausalLM


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


def fp8_args(strategy: str = "channel") -> QuantizationArgs:
    return QuantizationArgs(num_bits=8, type="float", strategy=strategy, symmetric=True)


def fp8_inputs() -> QuantizationArgs:
    """FP8 W8A8's inputs, as llm-compressor's FP8_DYNAMIC scheme declares them."""
    return QuantizationArgs(num_bits=8, type="float", strategy="token", symmetric=True, dynamic=True)


def write_compressed_checkpoint(
    out_dir: str | Path,
    variant: str = "llama",
    *,
    args: QuantizationArgs | None = None,
    inputs: QuantizationArgs | None = None,
    dtype: torch.dtype = torch.bfloat16,
    ignore=("lm_head",),
    overrides: dict | None = None,
) -> Path:
    """The tiny `variant` (config `overrides`) quantized by compressed-tensors with weight `args`
    (default: int4, symmetric, groups of 32) and input `inputs` (None: weight-only), its scales and
    float tensors in `dtype`, at `out_dir`; int weights pack-quantized, float ones float-quantized."""
    out = Path(out_dir)
    float_dir = write_tiny_model(out.with_name(out.name + "-float"), variant, overrides=overrides)
    model = AutoModelForCausalLM.from_pretrained(float_dir, dtype=dtype)
    args = args or weight_args()
    scheme = QuantizationScheme(targets=["Linear"], weights=args, input_activations=inputs)
    config = QuantizationConfig(config_groups={"group_0": scheme}, ignore=list(ignore))
    apply_quantization_config(model, config, show_progress=False)
    for module in model.modules():
        if getattr(module, "quantization_scheme", None) is not None:
            _observe_min_max(module)
    fmt = "pack-quantized" if args.type == "int" else "float-quantized"
    compressor = ModelCompressor.from_pretrained_model(model, fmt)
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
    elif args.strategy == "tensor":
        low, high = weight.amin(), weight.amax()
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
    modules = {name.removesuffix(".weight_scale") for name in stored if name.endswith(".weight_scale")}
    compressed = {name for name in stored if name.partition(".weight")[0] in modules and ".weight" in name}
    weights = {name: t.float() for name, t in stored.items() if name not in compressed}  # biases, norms
    for module in modules:
        packed = module + ".weight_packed" in stored
        compressor = PackedQuantizationCompressor if packed else NaiveQuantizationCompressor
        parts = {key: stored[f"{module}.{key}"] for key in compressor.compression_param_names(scheme)}
        if scale_dtype is not None:
            parts["weight_scale"] = parts["weight_scale"].to(scale_dtype)
        weights[module + ".weight"] = compressor.decompress(parts, scheme)["weight"]
    return weights


def float_twin(model_dir: str | Path, out_dir: str | Path) -> Path:
    """The checkpoint's decompressed weights (float32, exact) as a float checkpoint."""
    return float_checkpoint(model_dir, out_dir, decompressed(model_dir))


# The router's (and Qwen2-MoE's shared-expert gate's) names, which llm-compressor's MoE recipes ignore.
MOE_ROUTERS = ("re:.*mlp.gate$", "re:.*block_sparse_moe.gate$", "re:.*shared_expert_gate$")
MIXTRAL_EXPERT = re.compile(r"\.block_sparse_moe\.experts\.\d+\.w[123]\.weight$")
ROUTER = re.compile(r"\.(mlp|block_sparse_moe)\.gate\.weight$")


def moe_quantizable(name: str, router: bool = False) -> bool:
    """Whether a MoE checkpoint's quantizer packs `name`: every linear projection, the experts'
    included, but the head (and the router, unless `router`, which tpserve must refuse)."""
    linear = name.endswith("_proj.weight") or MIXTRAL_EXPERT.search(name) is not None
    return linear or (router and ROUTER.search(name) is not None)


def write_compressed_moe_checkpoint(
    out_dir: str | Path,
    family: str,
    *,
    args: QuantizationArgs | None = None,
    dtype: torch.dtype = torch.bfloat16,
    router: bool = False,
    **overrides,
) -> Path:
    """The tiny MoE `family` (tests/tiny_hf_models.py, config `overrides`) with every projection,
    each expert's too, quantized by compressed-tensors (weight `args`, default int4 symmetric in
    groups of 32) and pack-quantized, its scales and float tensors in `dtype`; the routers float
    unless `router`."""
    out = Path(out_dir)
    write_hf_model(out, family, **overrides)
    args = args or weight_args()
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    stored = {}
    for name, weight in load_file(out / "model.safetensors").items():
        weight = weight.to(dtype)
        if not moe_quantizable(name, router):
            stored[name] = weight
            continue
        module = name.removesuffix("weight")
        parts = {"weight": weight} | _min_max_qparams(weight, args)
        compressed = PackedQuantizationCompressor.compress(parts, scheme)
        stored |= {module + key: value for key, value in compressed.items()}
    save_file(stored, str(out / "model.safetensors"))
    ignore = ["lm_head"] + ([] if router else list(MOE_ROUTERS))
    config = QuantizationConfig(
        config_groups={"group_0": scheme},
        ignore=ignore,
        format="pack-quantized",
        quantization_status="compressed",
    )
    ModelCompressor(quantization_config=config).update_config(out)
    return out


def _min_max_qparams(weight: torch.Tensor, args: QuantizationArgs) -> dict[str, torch.Tensor]:
    """weight_scale (and weight_zero_point) from the min and max per group or row, as
    _observe_min_max computes a module's."""
    if args.strategy == "group":
        grouped = weight.unflatten(-1, (-1, args.group_size))  # [out, groups, group_size]
        low, high = grouped.amin(dim=-1), grouped.amax(dim=-1)
    else:
        low, high = weight.amin(dim=1, keepdim=True), weight.amax(dim=1, keepdim=True)
    scale, zero_point = calculate_qparams(low, high, args)
    params = {"weight_scale": scale.to(weight.dtype)}
    if not args.symmetric:
        params["weight_zero_point"] = zero_point.to(torch.int8)
    return params
