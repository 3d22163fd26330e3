"""Reads one rank's slices of a safetensors checkpoint, applying the sharding table.

Only the rows or columns a rank's pieces own are kept; no other part of a tensor stays in memory.
On a GPU the files' pages are then dropped from the page cache (posix_fadvise DONTNEED): the
weights live in device memory, and on a unified-memory GPU (a GB10) the page cache is the same
memory the KV pool is sized from next.
"""

from __future__ import annotations

import json
import os
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from tpserve.ranks.block_tensors import BlockValues, StoredBlocks, stored_blocks
from tpserve.ranks.checkpoint_quantization import AWQ, GPTQ
from tpserve.ranks.errors import ModelFileError
from tpserve.ranks.fp8_tensors import Fp8Values, StoredFp8, holds_fp8
from tpserve.ranks.fused_tensors import StoredRows, fused_part
from tpserve.ranks.gptq_tensors import StoredAwq, StoredGptq, StoredGptqV2
from tpserve.ranks.int4_tensors import StoredInt4, holds_int4
from tpserve.ranks.int8_tensors import Int8Values, StoredInt8, may_be_int8
from tpserve.ranks.model_config import ModelConfig
from tpserve.ranks.packing import dequantized, owned
from tpserve.ranks.sharding import Piece, Split, piece_range, rule_for
from tpserve.ranks.stacked_experts import StoredExpertPart, stacked_part
from tpserve.ranks.weight_names import expected_shape, kept_in_float32, required_names


@dataclass
class RankWeights:
    replicated: dict[str, torch.Tensor] = field(default_factory=dict)
    # One per local piece; a weight an int8 checkpoint ships in int8 is its Int8Values, one an
    # imported GGUF or an int4 checkpoint keeps in blocks its BlockValues, an fp8 one's on a GPU its
    # Fp8Values.
    pieces: list[dict[str, torch.Tensor | Int8Values | BlockValues | Fp8Values]] = field(default_factory=list)
    dtype: torch.dtype = torch.float32  # the model's (some families keep their norms in float32)


FLOAT_DTYPES = ("F32", "F16", "BF16", "F64")  # safetensors' names
# (quant_method, format) -> the reader of its qweight and the rest
PACKED_INT4 = {(GPTQ, "gptq"): StoredGptq, (GPTQ, "gptq_v2"): StoredGptqV2, (AWQ, "gemm"): StoredAwq}


def checkpoint_files(model_dir: Path) -> dict[str, Path]:
    """Tensor name -> file, from model.safetensors or model.safetensors.index.json."""
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as error:
            raise ModelFileError(index, f"not a safetensors index ({error})") from None
        return {name: model_dir / file for name, file in weight_map.items()}
    single = model_dir / "model.safetensors"
    if not single.exists():
        raise ModelFileError(model_dir, "no model.safetensors or model.safetensors.index.json")
    with _open(single) as handle:
        return dict.fromkeys(handle.keys(), single)


def stored_name(files: dict[str, Path], name: str) -> str | None:
    """Where a text-model tensor sits in this checkpoint: under its own name, or inside a
    vision-language checkpoint (transformers 4 wrote `language_model.model.*`, 5 `model.language_model.*`;
    Idefics3 and SmolVLM `model.text_model.*`)."""
    candidates = [name]
    if name.startswith("model."):
        inner = name.removeprefix("model.")
        candidates += ["language_model." + name, "model.language_model." + inner, "model.text_model." + inner]
    elif name.startswith("lm_head."):  # the head's weight, or its int8 scale
        candidates.append("language_model." + name)
    return next((candidate for candidate in candidates if candidate in files), None)


def _open(path: Path):
    if not path.exists():
        raise ModelFileError(path, "missing (named by the safetensors index)")
    try:
        return safe_open(str(path), framework="pt")
    except (SafetensorError, OSError) as error:
        raise ModelFileError(path, f"not a readable safetensors file ({error})") from None


def read_rank_weights(
    model_dir: str | Path,
    config: ModelConfig,
    pieces: list[Piece],
    dtype: torch.dtype,
    device="cpu",
    drop_cached: bool | None = None,
) -> RankWeights:
    """drop_cached: drop the files' pages from the page cache once read (None: on a GPU, whose
    weights no longer need them; a CPU's may still be the pages' own, and a restart reads them)."""
    model_dir = Path(model_dir)
    files = checkpoint_files(model_dir)
    weights = _read_pieces(model_dir, config, files, pieces, dtype, device)
    if drop_cached if drop_cached is not None else torch.device(device).type == "cuda":
        for path in sorted(set(files.values())):
            drop_from_page_cache(path)
    return weights


def _read_pieces(
    model_dir: Path, config: ModelConfig, files: dict[str, Path], pieces: list[Piece], dtype, device
) -> RankWeights:
    weights = RankWeights(pieces=[{} for _ in pieces], dtype=dtype)
    with ExitStack() as stack:
        handles = {path: stack.enter_context(_open(path)) for path in sorted(set(files.values()))}
        for name in required_names(config):
            tensor = _stored_tensor(model_dir, config, files, handles, name, dtype)
            if tensor.shape != expected_shape(config, name):
                raise ModelFileError(
                    tensor.path,
                    f"tensor {name} has shape {list(tensor.shape)}, config.json implies {list(expected_shape(config, name))}",
                )
            split, unit = rule_for(name)
            if split is Split.REPLICATED:
                kept = torch.float32 if kept_in_float32(config, name) else dtype
                # float whatever its stored kind: norms, routers and sinks are no quantized product
                weights.replicated[name] = owned(dequantized(tensor.read()), device, kept)
                continue
            for local, piece in enumerate(pieces):
                start, end = piece_range(config, piece, unit)
                part = tensor.read(start, end, columns=split is Split.ROW)
                weights.pieces[local][name] = owned(part, device, dtype)
    return weights


def drop_from_page_cache(path: Path) -> None:
    """Tell the kernel `path`'s cached pages are not needed again (a no-op where the OS has no
    posix_fadvise): clean pages no mapping holds are freed at once."""
    if not hasattr(os, "posix_fadvise"):
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


class StoredFloat:
    """A float tensor in the checkpoint; `read` takes a piece's slice of it, as StoredInt8's does."""

    def __init__(self, path: Path, tensor_slice):
        self.path, self._slice = path, tensor_slice
        self.shape = tuple(tensor_slice.get_shape())

    def read(self, start: int = 0, end: int | None = None, columns: bool = False) -> torch.Tensor:
        """The whole tensor, or rows [start, end), or (columns) columns [start, end)."""
        if end is None and not start:
            return self._slice[:]
        return self._slice[:, start:end] if columns else self._slice[start:end]


def _stored_tensor(
    model_dir: Path, config: ModelConfig, files: dict[str, Path], handles: dict, name: str, dtype
) -> StoredFloat | StoredInt8 | StoredInt4 | StoredGptq | StoredFp8 | StoredBlocks | StoredExpertPart:
    """`name`'s tensor in the checkpoint: float, or (a compressed-tensors checkpoint's quantized
    layer, a weight_scale beside it) int8, int4 or fp8, or a GPTQ or AWQ checkpoint's int4 (a
    qweight in its place), or (a GGUF import's) blocks, or one expert's part of stacked experts
    (float or MXFP4, decoded to dtype)."""
    stacked = stacked_part(config, name)
    # a GGUF import writes gpt-oss's experts one at a time, as other families store theirs
    per_expert = stored_name(files, name) is not None or stored_blocks(files, name) is not None
    if stacked is not None and not per_expert:
        return StoredExpertPart(handles, files, config, stacked, dtype)
    fused = fused_part(config, name)
    whole_stored = fused is not None and (stored_name(files, fused[0]) or stored_blocks(files, fused[0]))
    if whole_stored and stored_name(files, name) is None:
        whole = _stored_tensor(model_dir, config, files, handles, fused[0], dtype)
        return StoredRows(whole, *fused)
    scheme = config.quantization
    packed = PACKED_INT4.get((scheme.method, scheme.formats[0])) if scheme else None
    qweight = stored_name(files, name.removesuffix("weight") + "qweight") if packed else None
    if qweight is not None and may_be_int8(name):
        return packed(handles, files, qweight.removesuffix("qweight"), scheme.group_size)
    scale = stored_name(files, name + "_scale") if scheme and may_be_int8(name) else None
    if scale is not None:
        quantized = scale.removesuffix("_scale")
        if holds_fp8(handles, files, quantized, scheme.kinds):
            return StoredFp8(handles, files, quantized)
        if holds_int4(handles, files, quantized, scheme.kinds):
            return StoredInt4(handles, files, quantized)
        return StoredInt8(handles, files, quantized)
    blocks = stored_blocks(files, name)
    if blocks is not None:
        return StoredBlocks(handles, files, name, blocks)
    stored = stored_name(files, name)
    if stored is None:
        quantized = _quantized_form(files, name)
        if quantized is not None:
            raise _quantized_refusal(files, name, quantized)
        raise ModelFileError(model_dir, f"checkpoint has no tensor {name!r}")
    tensor = handles[files[stored]].get_slice(stored)
    if tensor.get_dtype() not in FLOAT_DTYPES and stored_name(files, name + "_scale") is not None:
        raise _quantized_refusal(files, name, stored)  # an int8 router, say (a projection's is read above)
    if tensor.get_dtype() not in FLOAT_DTYPES:
        why = "no weight_scale beside it" if config.quantization else "config.json declares no quantization"
        raise ModelFileError(files[stored], f"tensor {stored} is {tensor.get_dtype()}, not a float ({why})")
    return StoredFloat(files[stored], tensor)


# What stands in a quantized checkpoint in place of a float `X.weight`: GPTQ's and AWQ's qweight,
# compressed-tensors' packed values or scale.
QUANTIZED_FORMS = ("qweight", "weight_packed", "weight_scale")


def _quantized_form(files: dict[str, Path], name: str) -> str | None:
    """The stored name of `name`'s quantized form, where the checkpoint holds one."""
    module = name.removesuffix("weight")
    return next(
        (stored for form in QUANTIZED_FORMS if (stored := stored_name(files, module + form)) is not None),
        None,
    )


def _quantized_refusal(files: dict[str, Path], name: str, stored: str) -> ModelFileError:
    """The refusal of a weight tpserve reads only in float (a router, a gate, an embedding, a
    norm) that the checkpoint stores quantized."""
    return ModelFileError(
        files[stored],
        f"tensor {stored}: {name.removesuffix('.weight')} is stored quantized, which is not supported "
        "(only linear projections, experts' included, and lm_head are read quantized; a router, a "
        "gate or an embedding must be float)",
    )
