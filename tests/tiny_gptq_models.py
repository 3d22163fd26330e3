"""Tiny GPTQ (v1 and v2, desc_act false) and AWQ (GEMM) int4 checkpoints, packed as their libraries pack them.

No GPTQ or AWQ library is installed here, so the packing and the reference dequantization follow
their own code. GPTQ: auto_gptq/nn_modules/qlinear/qlinear_cuda_old.py (AutoGPTQ/AutoGPTQ):
`QuantLinear.pack` puts input 8r + j of the integer weight [in, out] in bits 4j..4j+3 of qweight row r
(`qweight[row] |= intweight[j] << (bits * (j - i))`), takes one from every zero point (`zeros -= 1`)
and packs output 8c + j of zeros [groups, out] into bits 4j.. of qzeros column c, as uint32 then
viewed as int32; its forward (without the CUDA extension) shifts by 0, 4, .., 28, masks with 15,
adds one to the zeros and takes scales * (weight - zeros), in float16. GPTQ v2 is v1 with the one
added back to every stored zero point (GPTQModel's convert_gptq_v1_to_v2_format). AWQ:
awq/modules/linear/gemm.py (casper-hansen/AutoAWQ): `WQLinear_GEMM.from_linear` packs output
8c + order_map[i] of the integer weight [in, out] (and of the zeros [groups, out], stored as they
are) into bits 4i.. of column c, order_map [0, 2, 4, 6, 1, 3, 5, 7]; awq/utils/packing_utils.py's
`dequantize_gemm` unpacks, undoes the order (AWQ_REVERSE_ORDER) and takes (iweight - izeros) *
scales. `dequantized` does either in float32 (and in float16 when asked), reading the file, not our
loader. Each weight's scale and zero point come from its min and max per group, as AutoGPTQ's
Quantizer.find_params computes them (xmin <= 0 <= xmax; symmetric: zero (15 + 1) / 2); scales are
float16 and the float tensors float16, as both save a model.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from tiny_int8_models import is_quantizable
from tiny_models import write_tiny_model

BITS, MAXQ = 4, 15
SHIFTS = torch.arange(0, 32, BITS, dtype=torch.int32)  # AutoGPTQ's wf
AWQ_ORDER_MAP = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ's order_map
AWQ_REVERSE_ORDER = [0, 4, 1, 5, 2, 6, 3, 7]
PACKED = ("qweight", "qzeros", "scales", "g_idx")


def gptq_config(group_size: int = 32, sym: bool = True, **overrides) -> dict:
    """quantization_config as AutoGPTQ / optimum write it."""
    return {
        "quant_method": "gptq",
        "bits": BITS,
        "group_size": group_size,
        "desc_act": False,
        "sym": sym,
        "damp_percent": 0.01,
        "true_sequential": True,
        "static_groups": False,
        "checkpoint_format": "gptq",
    } | overrides


def awq_config(group_size: int = 32, **overrides) -> dict:
    """quantization_config as AutoAWQ writes it."""
    return {
        "quant_method": "awq",
        "zero_point": True,
        "group_size": group_size,
        "bits": BITS,
        "version": "gemm",
    } | overrides


def write_gptq_checkpoint(
    out_dir: str | Path,
    variant: str = "llama",
    *,
    method: str = "gptq",
    group_size: int = 32,
    sym: bool = True,
    overrides: dict | None = None,
    keep_float: tuple[str, ...] = (),
) -> Path:
    """The tiny `variant` (config `overrides`) with every linear but lm_head (and those named with
    one of `keep_float`, as AutoAWQ's modules_to_not_convert) packed by `method` (gptq, gptq_v2 or
    awq) at `out_dir`."""
    out = Path(out_dir)
    write_tiny_model(out, variant, overrides=overrides)
    return pack_checkpoint(out, method=method, group_size=group_size, sym=sym, keep_float=keep_float)


def pack_checkpoint(
    out: Path,
    *,
    method: str = "gptq",
    group_size: int = 32,
    sym: bool = True,
    keep_float: tuple[str, ...] = (),
    quantizable=is_quantizable,
) -> Path:
    """The float checkpoint at `out`, rewritten in place: every weight `quantizable` names but
    lm_head (and those named with one of `keep_float`) packed by `method`, the rest float16."""
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = (
        awq_config(group_size) if method == "awq" else gptq_config(group_size, sym, checkpoint_format=method)
    )
    (out / "config.json").write_text(json.dumps(config, indent=1))
    packer = {"gptq": pack, "gptq_v2": functools.partial(pack, zero_offset=0), "awq": pack_awq}[method]
    stored = {}
    for name, weight in load_file(out / "model.safetensors").items():
        if not quantizable(name) or name == "lm_head.weight" or any(part in name for part in keep_float):
            stored[name] = weight.to(torch.float16)
            continue
        module = name.removesuffix("weight")
        group = weight.shape[1] if group_size == -1 else group_size
        q, zeros, scales = quantize(weight, group, sym)
        stored |= {module + key: value for key, value in packer(q, zeros, scales, group).items()}
    save_file(stored, str(out / "model.safetensors"))
    return out


def quantize(weight: torch.Tensor, group_size: int, sym: bool):
    """(q [out, in] int 0..15, zeros [out, groups] int 1..15, scales [out, groups] float16): min and
    max per group of inputs (the last group may be short), as AutoGPTQ's Quantizer finds them."""
    num_in = weight.shape[1]
    starts = range(0, num_in, group_size)
    low = torch.stack([weight[:, s : s + group_size].amin(1).clamp(max=0) for s in starts], 1)
    high = torch.stack([weight[:, s : s + group_size].amax(1).clamp(min=0) for s in starts], 1)
    if sym:
        high = torch.maximum(low.abs(), high)
        low = -high
    scales = ((high - low) / MAXQ).to(torch.float16)
    zeros = torch.full_like(low, (MAXQ + 1) // 2) if sym else torch.round(-low / scales.float())
    # v1 stores zero - 1 as an unsigned nibble: a zero of 0 would wrap (AutoGPTQ's known flaw).
    zeros = zeros.clamp(1, MAXQ).to(torch.int64)
    group_of = torch.arange(num_in) // group_size
    q = torch.round(weight / scales.float()[:, group_of]) + zeros[:, group_of]
    return q.clamp(0, MAXQ).to(torch.int64), zeros, scales


def pack(
    q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, group_size: int, zero_offset: int = 1
) -> dict[str, torch.Tensor]:
    """AutoGPTQ's QuantLinear.pack of integer weights q [out, in], zeros and scales [out, groups];
    zero_offset 0: GPTQModel's v2, whose convert_gptq_v1_to_v2_format adds the one back to every
    zero point."""
    intweight = q.t().contiguous().numpy().astype(np.uint32)  # [in, out]
    # AutoGPTQ sizes these `// 32 * bits`, which needs multiples of 32; `// 8` is the same there and
    # also holds the tiny models' 48 KV outputs (as GPTQModel's `// pack_factor` does).
    qweight = np.zeros((intweight.shape[0] // 8, intweight.shape[1]), dtype=np.uint32)
    for row in range(qweight.shape[0]):
        for j in range(32 // BITS):
            qweight[row] |= intweight[row * 8 + j] << (BITS * j)
    stored_zeros = (zeros.t().contiguous() - zero_offset).numpy().astype(np.uint32)  # [groups, out]
    qzeros = np.zeros((stored_zeros.shape[0], stored_zeros.shape[1] // 8), dtype=np.uint32)
    for col in range(qzeros.shape[1]):
        for j in range(32 // BITS):
            qzeros[:, col] |= stored_zeros[:, col * 8 + j] << (BITS * j)
    num_in = q.shape[1]
    return {
        "qweight": torch.from_numpy(qweight.astype(np.int32)),
        "qzeros": torch.from_numpy(qzeros.astype(np.int32)),
        "scales": scales.t().contiguous(),
        "g_idx": torch.tensor([i // group_size for i in range(num_in)], dtype=torch.int32),
    }


def pack_awq(
    q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, group_size: int
) -> dict[str, torch.Tensor]:
    """AutoAWQ's WQLinear_GEMM.from_linear packing of q [out, in], zeros and scales [out, groups]."""
    intweight = q.t().contiguous().to(torch.int32)  # [in, out]
    zeros = zeros.t().contiguous().to(torch.int32)  # [groups, out]

    def packed(values: torch.Tensor) -> torch.Tensor:
        words = torch.zeros(values.shape[0], values.shape[1] // 8, dtype=torch.int32)
        for col in range(words.shape[1]):
            for i in range(8):
                words[:, col] |= values[:, col * 8 + AWQ_ORDER_MAP[i]] << (i * BITS)
        return words

    return {"qweight": packed(intweight), "qzeros": packed(zeros), "scales": scales.t().contiguous()}


def dequantize(
    tensors: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32, zero_offset: int = 1
) -> torch.Tensor:
    """weight [out, in] from qweight, qzeros, scales and g_idx, as AutoGPTQ's forward unpacks them
    (its float16 arithmetic where dtype is float16); zero_offset 0 for v2."""
    qweight, qzeros = tensors["qweight"], tensors["qzeros"]
    zeros = torch.bitwise_right_shift(qzeros.unsqueeze(2).expand(-1, -1, 32 // BITS), SHIFTS.view(1, 1, -1))
    zeros = (zeros & MAXQ) + zero_offset
    zeros = zeros.reshape(zeros.shape[0], -1)  # [groups, out]
    weight = torch.bitwise_right_shift(qweight.unsqueeze(1).expand(-1, 32 // BITS, -1), SHIFTS.view(1, -1, 1))
    weight = (weight & MAXQ).reshape(-1, weight.shape[2])  # [in, out]
    g_idx = tensors["g_idx"].long()
    scales = tensors["scales"].to(dtype)
    return (scales[g_idx] * (weight - zeros[g_idx]).to(dtype)).t().contiguous()


def dequantize_awq(tensors: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """weight [out, in] as AutoAWQ's dequantize_gemm computes it (unpack_awq, reverse_awq_order)."""

    def unpacked(words: torch.Tensor) -> torch.Tensor:  # [n, words] -> [n, 8 * words], outputs in order
        values = torch.bitwise_right_shift(words[:, :, None], SHIFTS[None, None, :]).view(words.shape[0], -1)
        order = torch.arange(values.shape[-1]).view(-1, 8)[:, AWQ_REVERSE_ORDER].view(-1)
        return values[:, order] & MAXQ

    iweight, izeros = unpacked(tensors["qweight"]), unpacked(tensors["qzeros"])  # [in, out], [groups, out]
    group_size = iweight.shape[0] // izeros.shape[0]
    scales = tensors["scales"].to(dtype).repeat_interleave(group_size, dim=0)
    izeros = izeros.repeat_interleave(group_size, dim=0)
    return ((iweight - izeros).to(dtype) * scales).t().contiguous()


def dequantized(model_dir: str | Path, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Every weight of the checkpoint at `model_dir` as AutoGPTQ or AutoAWQ dequantizes it (in
    `dtype`); the rest as stored, in float32."""
    config = json.loads((Path(model_dir) / "config.json").read_text())["quantization_config"]
    v2 = config.get("checkpoint_format") == "gptq_v2"
    unpack = (
        dequantize_awq
        if config["quant_method"] == "awq"
        else functools.partial(dequantize, zero_offset=1 - v2)
    )
    stored = load_file(Path(model_dir) / "model.safetensors")
    modules = {name.removesuffix("qweight") for name in stored if name.endswith(".qweight")}
    weights = {name: t.float() for name, t in stored.items() if name.rpartition(".")[2] not in PACKED}
    for module in modules:
        parts = {key: stored[module + key] for key in PACKED if module + key in stored}
        weights[module + "weight"] = unpack(parts, dtype=dtype).float()
    return weights
