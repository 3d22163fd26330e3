"""A rank's loaded weights as the products take them: fused (q/k/v, gate/up) and packed in their format.

A loaded weight is float, a compressed-tensors checkpoint's int8 (tpserve/ranks/int8_tensors.py) or blocks:
a GGUF import's (tpserve/ranks/block_tensors.py), a compressed-tensors int4 checkpoint's
(tpserve/ranks/int4_tensors.py) or a GPTQ or AWQ one's (tpserve/ranks/gptq_tensors.py). A checkpoint's int8 is
served as stored whatever the format asked; blocks are served as stored where the format takes their
bits; anything else is quantized (or kept float) as tpserve/kernels/weight_formats.py says. On a GPU, 4-bit
blocks go to torch's int4 weight-only product (tpserve/kernels/int4pack_linear.py) and a compressed-tensors
checkpoint's fp8 weights (tpserve/ranks/fp8_tensors.py) to torch._scaled_mm (tpserve/kernels/fp8_linear.py)
instead of bfloat16.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from tpserve.kernels.fp8_linear import Fp8Weight, fp8_unfit
from tpserve.kernels.int4pack_linear import Int4PackWeight, int4pack_unfit
from tpserve.kernels.int8_linear import Int8Weight
from tpserve.kernels.mxfp4_linear import Mxfp4Weight
from tpserve.kernels.q4_linear import Q4Weight
from tpserve.kernels.q5_linear import Q5Weight
from tpserve.kernels.q6_linear import Q6Weight
from tpserve.kernels.q8_linear import Q8Weight
from tpserve.kernels.stacked_weight import StackedWeight
from tpserve.kernels.weight_formats import ROW_FORMATS, quantize_weight
from tpserve.ranks.block_tensors import MXFP4, BlockValues, cat_blocks
from tpserve.ranks.errors import ModelFileError
from tpserve.ranks.fp8_tensors import Fp8Values
from tpserve.ranks.int8_tensors import Int8Values
from tpserve.ranks.tensor_fields import owned_fields, owned_tensor, rows_of_fields, rows_of_tensor

# Blocks served as stored, by their values' bits: the kinds that take them as they are, and how.
# A 4- or 5-bit head goes to 8 bits under q8, as a float head does; a Q6_K head keeps its 6 bits.
AS_STORED = {
    4: (("int4",), lambda b: Q4Weight.from_blocks(b.q, b.d, b.m)),
    5: (("int4",), lambda b: Q5Weight.from_blocks(b.q, b.d, b.m)),
    6: (("int4", "q8"), lambda b: Q6Weight.from_blocks(b.q, b.sc, b.d)),
    8: (("int4", "q8"), lambda b: Q8Weight.from_blocks(b.q, b.d)),
    MXFP4: (("int4",), lambda b: Mxfp4Weight.from_blocks(b.q, b.d)),
}
# _scaled_mm with a scale per input row and per output channel: Hopper (sm_90) and newer under CUDA
FP8_ROWWISE_CAPABILITY = (9, 0)


@dataclass
class MixedParts:
    """The parts of one fused product stored in different forms (a Q4_K_M GGUF's Q4_K q and k beside
    its Q6_K v, or blocks beside floats): stacked at packing (pack_weight)."""

    parts: list[torch.Tensor | BlockValues | Fp8Values]

    @property
    def num_rows(self) -> int:
        return sum(part.shape[0] for part in self.parts)

    def dequantize(self) -> torch.Tensor:
        """[sum of out, in] float32: every part's exact values."""
        return torch.cat([dequantized(part).float() for part in self.parts])


@dataclass(frozen=True)
class StoredKind:
    """What is done with a weight of one stored kind, from the file to its served form. None: a step
    never asked of it (mixed parts are made by fuse, after loading)."""

    own: Callable | None  # (weight, device, dtype): on the device, in storage of its own (at load)
    take_rows: Callable | None  # (weight, rows): its rows in that order (a partial rotary's reorder)
    stack: Callable | None  # (parts): stacked by rows as one weight of this kind, or None where they do not
    dequantize: Callable  # (weight): its exact values in float (a float weight as it is)
    pack: Callable  # (weight, format, dtype): its served form (pack_weight)


def stored_kind(weight) -> StoredKind:
    """The kind a loaded weight is stored in: float (torch.Tensor), a checkpoint's int8 or fp8 values
    with their scales, blocks (tpserve/ranks/block_tensors.py), or mixed parts: its entry in STORED_KINDS."""
    kind = next((k for k in type(weight).__mro__ if k in STORED_KINDS), None)
    if kind is None:
        raise TypeError(f"no served form for a weight stored as {type(weight).__name__}")
    return STORED_KINDS[kind]


def owned(weight, device, dtype: torch.dtype):
    """`weight` on the device in storage of its own: a float one in `dtype`, values and scales in their own
    (tpserve/ranks/tensor_fields.py), a CPU's fp8 dequantized to `dtype` (no CPU product takes fp8)."""
    return stored_kind(weight).own(weight, device, dtype)


def rows_taken(weight, rows: torch.Tensor):
    """`weight`'s rows in the order `rows` gives (each row its own values and scales)."""
    return stored_kind(weight).take_rows(weight, rows)


def dequantized(weight) -> torch.Tensor:
    """`weight`'s exact values in float: a float weight itself, any other dequantized to float32."""
    return stored_kind(weight).dequantize(weight)


def _stack_scaled(parts: list):
    """int8 or fp8 parts stacked, each part keeping its rows' scales."""
    return type(parts[0])(torch.cat([p.values for p in parts]), torch.cat([p.scales for p in parts]))


def _stack_blocks(parts: list[BlockValues]) -> BlockValues | None:
    """Blocks stacked, where all are of one width in bits."""
    return cat_blocks(parts) if len({part.bits for part in parts}) == 1 else None


def _own_fp8(weight: Fp8Values, device, dtype: torch.dtype):
    """Kept as stored on a GPU (pack_fp8); the CPU's is float."""
    if torch.device(device).type != "cuda":
        return owned_tensor(weight.dequantize(), device, dtype)
    return owned_fields(weight, device, dtype)


def fuse(tensors: dict, names: list[str]) -> torch.Tensor | Int8Values | Fp8Values | BlockValues | MixedParts:
    """The weights `names`, taken out of `tensors`, stacked by rows (q/k/v, gate/up): all float, all
    int8 or all fp8 each keeping its scales, or all in blocks of one width (else their MixedParts)."""
    parts = [tensors.pop(name) for name in names]
    kinds = {stored_kind(part) for part in parts}
    stacked = next(iter(kinds)).stack(parts) if len(kinds) == 1 else None
    if stacked is not None:
        return stacked
    if STORED_KINDS[Int8Values] not in kinds:  # floats beside blocks (a mixed GGUF) or fp8
        return MixedParts(parts)
    raise ModelFileError(", ".join(names), "one fused product, stored partly in int8 and partly in float")


def pack_weight(
    weight: torch.Tensor | Int8Values | Fp8Values | BlockValues | MixedParts, kind: str, dtype=torch.float32
):
    """A weight as the products take it, in the served form its stored kind and `kind` (a format of
    tpserve/kernels/weight_formats.py) choose: STORED_KINDS, the one table from a stored weight to its
    served form. A checkpoint's int8 is served as stored whatever `kind` (down_proj included: the
    file chose int8 for it); a GGUF's blocks are served as stored where `kind` is int4 (and 8- and
    6-bit ones where it is q8: a Q6_K head keeps its 6 bits; 4- and 5-bit heads go to 8 bits, as a
    float head does), mixed parts each in its own form, stacked (tpserve/kernels/stacked_weight.py);
    anything else goes through quantize_weight (blocks dequantized first, exactly, to `dtype` where
    they stay float: int8 and none serve a Q6_K's exact values as they serve a Q4's)."""
    return stored_kind(weight).pack(weight, kind, dtype)


def _pack_float(weight: torch.Tensor, kind: str, dtype: torch.dtype):
    return quantize_weight(weight, kind)


def _pack_int8(weight: Int8Values, kind: str, dtype: torch.dtype):
    if weight.values.numel() == 0:  # a piece holding no KV head has an empty q/k/v
        return weight.values.float()
    return Int8Weight.from_int8(weight.values, weight.scales)


def _pack_blocks(weight: BlockValues, kind: str, dtype: torch.dtype):
    if weight.q.numel() == 0:
        return weight.q.to(dtype)
    if _on_gpu_in_int4(weight, kind, dtype):
        return Int4PackWeight.from_blocks(weight.q, weight.d, weight.m, dtype)
    kinds, pack = AS_STORED[weight.bits]
    if kind in kinds:
        return pack(weight)
    return quantize_weight(weight.dequantize().to(dtype if kind == "none" else torch.float32), kind)


def _pack_mixed(weight: MixedParts, kind: str, dtype: torch.dtype):
    if kind != "int4" or weight.num_rows == 0:  # no KV head: an empty q/k/v
        return pack_weight(weight.dequantize(), kind, dtype)
    # Blocks in 4 bits are per output row, so each part packed alone is the fused product's rows.
    return StackedWeight([pack_weight(part, kind, dtype) for part in weight.parts])


def pack_embedding(weight: torch.Tensor | BlockValues | Fp8Values, head_format: str, dtype: torch.dtype):
    """An embedding table of its own (where the head's cannot be read by rows): 8-bit blocks where the
    head is in them (6-bit ones where the file keeps it in Q6_K), else float."""
    packed = pack_weight(weight, "q8") if head_format == "q8" else None
    if isinstance(packed, ROW_FORMATS):
        return packed
    return dequantized(weight).to(dtype)


def _on_gpu_in_int4(weight: BlockValues, kind: str, dtype: torch.dtype) -> bool:
    """Whether 4-bit blocks on a GPU are served by torch's int4 product (tpserve/kernels/int4pack_linear.py)
    rather than expanded to bfloat16: a GPU's weights in bfloat16 (the CUDA kernel's rows) whose
    shape the packed layout takes; `quantize` on a GPU is "none" (the CPU formats do not run there)."""
    return (
        kind == "none"
        and weight.bits == 4
        and dtype == torch.bfloat16
        and weight.q.device.type == "cuda"
        and int4pack_unfit(*weight.q.shape, weight.q.device) is None
    )


def fp8_on_gpu(
    device_type: str, capability: tuple[int, int], kind: str, dtype: torch.dtype, shape: tuple[int, int]
) -> bool:
    """Whether a checkpoint's fp8 weight [out, in] is served in fp8 by torch._scaled_mm: on a GPU
    with row-wise scaled products (sm_90 and newer), weights in bfloat16 (the product's output),
    quantize none (the CPU formats do not run there) and a shape _scaled_mm takes."""
    return (
        device_type == "cuda"
        and tuple(capability) >= FP8_ROWWISE_CAPABILITY
        and kind == "none"
        and dtype == torch.bfloat16
        and 0 not in shape
        and fp8_unfit(*shape, device_type) is None
    )


def pack_fp8(weight: Fp8Values, kind: str, dtype: torch.dtype):
    """An fp8 weight kept as stored (only a GPU's are: tpserve/ranks/weights.py dequantizes the CPU's at
    load):
    in fp8 where fp8_on_gpu says so, else dequantized to `dtype` and served as a float weight."""
    device = weight.values.device
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else (0, 0)
    if fp8_on_gpu(device.type, capability, kind, dtype, tuple(weight.values.shape)):
        return Fp8Weight(weight.values, weight.scales, dtype)
    return quantize_weight(weight.dequantize().to(dtype if kind == "none" else torch.float32), kind)


def describe_serving(kinds: tuple[str, ...], quantize: str, device_type: str = "cpu") -> str:
    """In words: which of a checkpoint's quantized layers are served as the file stores them, and
    which `quantize` decides (fp8 on a GPU: tpserve/ranks/packing.py fp8_on_gpu)."""
    stored = ["int8"] if "int8" in kinds else []
    dequantized = ["fp8"] if "fp8" in kinds else []
    (stored if quantize == "int4" else dequantized).extend(["int4"] if "int4" in kinds else [])
    said = [f"its {' and '.join(stored)} layers served as stored"] if stored else []
    if dequantized:
        said.append(f"its {' and '.join(dequantized)} layers dequantized to float32")
    if "fp8" in kinds and device_type == "cuda":
        said[-1] += (
            " (the fp8 ones served in fp8 by torch._scaled_mm instead where the GPU is sm_90+ and the dtype bfloat16)"
        )
    if "mxfp4" in kinds:  # gpt-oss's experts (tpserve/ranks/mxfp4.py)
        said.append(
            "its mxfp4 experts served as stored, in MXFP4 blocks"
            if quantize == "int4"
            else "its mxfp4 experts dequantized exactly to dtype"
        )
    also = "them and to " if dequantized or ("mxfp4" in kinds and quantize != "int4") else ""
    return ", ".join(said) + f", quantize {quantize} applies to {also}those it left in float"


# A stored kind -> what is done with it: the one table from a loaded weight to its served form.
STORED_KINDS = {
    torch.Tensor: StoredKind(owned_tensor, rows_of_tensor, torch.cat, lambda w: w, _pack_float),
    Int8Values: StoredKind(owned_fields, rows_of_fields, _stack_scaled, Int8Values.dequantize, _pack_int8),
    Fp8Values: StoredKind(_own_fp8, rows_of_fields, _stack_scaled, Fp8Values.dequantize, pack_fp8),
    BlockValues: StoredKind(
        owned_fields, rows_of_fields, _stack_blocks, BlockValues.dequantize, _pack_blocks
    ),
    MixedParts: StoredKind(None, None, None, MixedParts.dequantize, _pack_mixed),
}
