"""A tiny gpt-oss re-encoded to MXFP4 as the real checkpoints store their experts, and its float twin.

The encoder here is the tests' own, from the OCP Microscaling spec: per block of 32 inputs the
smallest power of two 2^k that brings the block's largest magnitude within e2m1's 6, each value
rounded to the nearest of the eight magnitudes, its sign in bit 3; the code of the even element in
the low nibble. The twin holds the values the blocks decode to, stacked as transformers saves them,
so the two checkpoints hold the same numbers in two layouts.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

# e2m1's magnitudes by code 0..7 (codes 8..15: the same, negative)
MAGNITUDES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
MXFP4_CONFIG = {
    "quant_method": "mxfp4",
    "modules_to_not_convert": [
        "model.layers.*.self_attn",
        "model.layers.*.mlp.router",
        "model.embed_tokens",
        "lm_head",
    ],
}


def encode_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """weight: [..., rows, cols] (cols whole blocks of 32) -> blocks uint8 [..., rows, cols / 32, 16],
    scales uint8 [..., rows, cols / 32] and the values they decode to [..., rows, cols] float32."""
    *lead, cols = weight.shape
    w = weight.float().reshape(*lead, cols // 32, 32)
    top = w.abs().amax(-1)
    k = torch.where(top > 0, torch.ceil(torch.log2(top / 6.0)), torch.full_like(top, -127)).clamp(-127, 127)
    scaled = w / torch.exp2(k).unsqueeze(-1)
    codes = (scaled.abs().unsqueeze(-1) - MAGNITUDES).abs().argmin(-1)  # [..., G, 32] in 0..7
    decoded = MAGNITUDES[codes] * torch.where(scaled < 0, -1.0, 1.0) * torch.exp2(k).unsqueeze(-1)
    codes = codes | torch.where(scaled < 0, 8, 0)
    blocks = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)
    return blocks, (k + 127).to(torch.uint8), decoded.reshape(*lead, cols)


def write_mxfp4_pair(source: Path, out: Path) -> tuple[Path, Path]:
    """From the float gpt-oss at `source` (transformers-written): `out/mxfp4`, its experts' products
    in MXFP4 blocks and scales, and `out/twin`, the same model with those products as the blocks
    decode them, in float. Returns (mxfp4, twin)."""
    tensors = load_file(source / "model.safetensors")
    packed, twin = {}, {}
    for name, tensor in tensors.items():
        if not name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            packed[name] = twin[name] = tensor
            continue
        # stored input first ([E, hidden, 2I], [E, I, hidden]); blocks run along the input
        blocks, scales, decoded = encode_mxfp4(tensor.transpose(1, 2))
        packed[name + "_blocks"], packed[name + "_scales"] = blocks.contiguous(), scales.contiguous()
        twin[name] = decoded.transpose(1, 2).contiguous()
    pair = out / "mxfp4", out / "twin"
    for directory, weights in zip(pair, (packed, twin)):
        shutil.copytree(source, directory)
        save_file(weights, str(directory / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((pair[0] / "config.json").read_text())
    (pair[0] / "config.json").write_text(json.dumps(config | {"quantization_config": MXFP4_CONFIG}))
    return pair
