"""The weights side of a GGUF import: Hugging Face names, blocks or floats, sharded safetensors.

Every GGUF tensor is mapped to its Hugging Face name and torch shape before anything is written, so
an unknown tensor or type is refused up front. A Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K or Q8_0
weight matrix is kept in its own blocks (tpserve/gguf_blocks.py): `X.weight_q4`, `X.weight_q5` or
`X.weight_q8` with `X.weight_d` (and `X.weight_m`), float16 but for Q4_K's and Q5_K's float32, or
Q6_K's (and Q3_K's, in the same form) `X.weight_q6`, `X.weight_sc` and `X.weight_d`; Q2_K is
dequantized to float32; MXFP4 (gpt-oss's experts) keeps its codes and scale bytes. llama.cpp
stores llama-architecture q/k rows permuted for its rotary kernel; `unpermute_rotary_rows` undoes
that exactly, blocks included. A mixture of experts' stacked tensors ([E, out, in], or a bias [E, I])
are written one expert at a time under the names the engine reads (`mlp.experts.N.gate_proj.weight`),
each expert's rows its own blocks, so nothing about them is rounded either.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from safetensors.numpy import save_file
from tqdm import tqdm

from tpserve.gguf_blocks import KEPT_TYPES, kept_bytes, read_blocks
from tpserve.gguf_families import Family
from tpserve.kernels.mxfp4_linear import NAN_SCALE
from tpserve.ranks.errors import ModelFileError

logger = logging.getLogger(__name__)

# Shards stay well under the sizes that make single files awkward to copy or memory-map.
MAX_SHARD_BYTES = 2 << 30


_Q = gguf.GGMLQuantizationType
SUPPORTED_TYPES = frozenset(
    {_Q.F32, _Q.F16, _Q.BF16, _Q.Q4_0, _Q.Q4_1, _Q.Q5_0, _Q.Q5_1, _Q.Q8_0}
    | {_Q.Q2_K, _Q.Q3_K, _Q.Q4_K, _Q.Q5_K, _Q.Q6_K, _Q.MXFP4}
)


_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(.+)")


@dataclass(frozen=True)
class PlannedTensor:
    """One GGUF tensor and where it goes: its Hugging Face name and torch shape."""

    source: Any  # gguf.ReaderTensor
    name: str
    shape: tuple[int, ...]
    rotary_heads: int  # > 0: undo llama.cpp's q/k permutation over this many heads
    keeps_blocks: bool = False  # written in its own blocks (a matrix of one of KEPT_TYPES)
    expert: int | None = None  # this expert's slice of a stacked [E, ...] source
    shift: float = 0.0  # taken off every value (what llama.cpp added to gemma3's norms)

    @property
    def num_bytes(self) -> int:
        values = int(np.prod(self.shape))
        return kept_bytes(self.source.tensor_type, values) if self.keeps_blocks else 4 * values


def plan_tensors(
    tensors: list[Any], config: dict[str, Any], family: Family, gguf_path: Path, keep_blocks: bool = True
) -> list[PlannedTensor]:
    """Map every GGUF tensor to its Hugging Face name, refusing unknown names and types up front."""
    plan, num_mtp_tensors = [], 0
    for tensor in tensors:
        if tensor.name in family.config_tensors:
            continue
        layer = _LAYER_TENSOR.fullmatch(tensor.name)
        if family.mtp_layers and layer and int(layer.group(1)) >= config["num_hidden_layers"]:
            num_mtp_tensors += 1  # a multi-token-prediction layer's (GLM-4.5's nextn): no drafts here
            continue
        if tensor.tensor_type not in SUPPORTED_TYPES:
            supported = ", ".join(sorted(qtype.name for qtype in SUPPORTED_TYPES))
            raise ModelFileError(
                gguf_path,
                f"tensor {tensor.name} has type {tensor.tensor_type.name}, which cannot be imported "
                f"(supported: {supported})",
            )
        name = _hf_name(tensor.name, family, gguf_path)
        # GGUF lists dimensions fastest-varying first; torch lists them slowest first.
        shape = tuple(int(dim) for dim in reversed(tensor.shape))
        if name.endswith(".shared_expert_gate.weight"):  # llama.cpp reads it as [hidden]; HF's [1, hidden]
            shape = (1, shape[-1])
        if "{}" in name:  # one expert's slice of a stacked tensor at a time
            blocks = keep_blocks and tensor.tensor_type in KEPT_TYPES and len(shape) == 3
            plan += [
                PlannedTensor(tensor, name.format(e), shape[1:], 0, blocks, expert=e) for e in range(shape[0])
            ]
            continue
        permutes_qk = family.permutes_qk
        rotary_heads = 0
        if permutes_qk and name.endswith(("q_proj.weight", "q_proj.bias")):
            rotary_heads = config["num_attention_heads"]
        elif permutes_qk and name.endswith(("k_proj.weight", "k_proj.bias")):
            rotary_heads = config["num_key_value_heads"]
        if rotary_heads and shape[0] != rotary_heads * config["head_dim"]:
            raise ModelFileError(
                gguf_path,
                f"tensor {tensor.name} has {shape[0]} rows, not {rotary_heads} heads x {config['head_dim']}",
            )
        blocks = keep_blocks and tensor.tensor_type in KEPT_TYPES and len(shape) == 2
        shift = family.norm_shift if name.endswith("norm.weight") else 0.0
        plan.append(PlannedTensor(tensor, name, shape, rotary_heads, blocks, shift=shift))
    if num_mtp_tensors:
        logger.info(
            "%s: %d tensors of its multi-token-prediction layers not imported", gguf_path, num_mtp_tensors
        )
    return sorted(plan, key=lambda item: _storage_order(item.name))


def unpermute_rotary_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Inverse of convert_hf_to_gguf's `permute`.

    llama.cpp stores each head's rows as interleaved pairs (row 0 of the first half, row 0 of the
    second half, ...); Hugging Face's rotary rotates halves. weight: [num_heads * head_dim, ...].
    """
    half = weight.shape[0] // num_heads // 2
    pairs = weight.reshape(num_heads, half, 2, *weight.shape[1:])
    return np.ascontiguousarray(pairs.swapaxes(1, 2).reshape(weight.shape))


def read_arrays(planned: PlannedTensor, gguf_path: Path) -> dict[str, np.ndarray]:
    """What the import writes for one tensor, by safetensors name: its blocks, or float32."""
    if not planned.keeps_blocks:
        return {planned.name: read_tensor(planned, gguf_path)}
    tensor = planned.source
    blocks = read_blocks(_data(planned), tensor.tensor_type, planned.shape)
    if tensor.tensor_type == _Q.MXFP4 and (blocks.d == NAN_SCALE).any():
        raise ModelFileError(gguf_path, f"tensor {tensor.name} has a NaN MXFP4 scale (255)")
    if planned.rotary_heads:
        rows = np.arange(planned.shape[0])
        blocks = blocks.rows(unpermute_rotary_rows(rows, planned.rotary_heads))
    return blocks.arrays(planned.name)


def read_tensor(planned: PlannedTensor, gguf_path: Path) -> np.ndarray:
    """The tensor as float32 in torch layout, with llama.cpp's permutation undone."""
    tensor = planned.source
    values = gguf.quants.dequantize(_data(planned), tensor.tensor_type)
    if values.size != int(np.prod(planned.shape)):
        raise ModelFileError(
            gguf_path, f"tensor {tensor.name} holds {values.size} values, not {planned.shape}"
        )
    values = values.reshape(planned.shape).astype(np.float32, copy=False)
    if planned.rotary_heads:
        values = unpermute_rotary_rows(values, planned.rotary_heads)
    if planned.shift:
        values = values - np.float32(planned.shift)
    return np.ascontiguousarray(values)


def _data(planned: PlannedTensor) -> np.ndarray:
    """The tensor's stored values or blocks [out, ...] (its expert's, of a stacked tensor)."""
    data = planned.source.data
    return data if planned.expert is None else data[planned.expert]


def _hf_name(gguf_name: str, family: Family, gguf_path: Path) -> str:
    """The Hugging Face name; an expert's holds "{}" where its number goes."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _LAYER_TENSOR.fullmatch(gguf_name)
    names = _LAYER_NAMES | family.layer_names
    if match and match.group(2) in names:
        return f"model.layers.{match.group(1)}.{names[match.group(2)]}"
    raise ModelFileError(gguf_path, f"tensor {gguf_name} is not one the importer knows how to place")


def _storage_order(name: str) -> tuple[int, int, str]:
    # Embeddings, then layers in numeric order, then the final norm and head: each shard holds
    # neighbouring layers.
    match = re.match(r"model\.layers\.(\d+)\.", name)
    if match:
        return (1, int(match.group(1)), name)
    return (0 if "embed_tokens" in name else 2, 0, name)


def write_weights(
    plan: list[PlannedTensor], out_dir: Path, gguf_path: Path, progress: bool, max_shard_bytes: int
) -> None:
    shards: list[list[PlannedTensor]] = [[]]
    shard_bytes = 0
    for planned in plan:
        if shards[-1] and shard_bytes + planned.num_bytes > max_shard_bytes:
            shards.append([])
            shard_bytes = 0
        shards[-1].append(planned)
        shard_bytes += planned.num_bytes
    num_shards = len(shards)
    file_names = (
        ["model.safetensors"]
        if num_shards == 1
        else [f"model-{index + 1:05d}-of-{num_shards:05d}.safetensors" for index in range(num_shards)]
    )
    weight_map = {}
    with tqdm(total=len(plan), unit="tensor", desc="import", disable=not progress) as bar:
        for file_name, shard in zip(file_names, shards):
            arrays = {}
            for planned in shard:
                written = read_arrays(planned, gguf_path)
                arrays.update(written)
                weight_map.update(dict.fromkeys(written, file_name))
                bar.update(1)
            save_file(arrays, str(out_dir / file_name), metadata={"format": "pt"})
    if num_shards > 1:
        total_size = sum(planned.num_bytes for planned in plan)
        index = {"metadata": {"total_size": total_size}, "weight_map": weight_map}
        (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
