"""The formats a weight can be served in, and which one "auto" picks on a device.

- none: the checkpoint's floats (tpserve/kernels/linear.py).
- int8: int8 weights x int8 rows by FBGEMM (tpserve/kernels/int8_linear.py), down_proj in float16
  (tpserve/kernels/fp16_linear.py).
- int4: 4-bit blocks x 8-bit blocks by our C kernel, every linear layer (tpserve/kernels/q4_linear.py):
  half int8's bytes, and the GGUF's own Q4_1 arithmetic; the head and the embedding in 8-bit blocks
  (tpserve/kernels/q8_linear.py), one copy for both where they are tied. A GGUF's own blocks are served as
  stored (tpserve/ranks/packing.py): Q8_0 in 8 bits, Q6_K in 6 (tpserve/kernels/q6_linear.py), the head
  included;
  Q5_0, Q5_1 and Q5_K in 5 (tpserve/kernels/q5_linear.py); gpt-oss's MXFP4 experts in MXFP4
  (tpserve/kernels/mxfp4_linear.py).
- auto: int4 on an x86 CPU whose vector units the C kernel uses (AVX2 or AVX-512 VNNI), else int8
  where FBGEMM runs, else none.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tpserve.kernels.fp16_linear import Fp16Weight
from tpserve.kernels.int8_linear import Int8Weight, PackedWeight, QuantizeError, int8_available
from tpserve.kernels.mxfp4_linear import mxfp4_available
from tpserve.kernels.q4_linear import BLOCK, Q4Weight, q4_available, supported_paths
from tpserve.kernels.q5_linear import q5_available
from tpserve.kernels.q6_linear import Q6Weight, q6_available
from tpserve.kernels.q8_linear import Q8Weight, q8_available

log = logging.getLogger(__name__)

QUANTIZE_CHOICES = ("none", "int8", "int4", "auto")


@dataclass(frozen=True)
class ServedAs:
    """The formats of one `quantize` choice: q/k/v, o and gate/up; down_proj; the head."""

    linear: str
    down: str
    head: str


_SERVED_AS = {
    "none": ServedAs("none", "none", "none"),
    # down_proj's input, SiLU(gate) * up, has outlier channels that one scale per row rounds away
    # (SmolLM2, bench/quality.py: +3.4% perplexity in int8, +0.6% kept in float): float16 instead.
    "int8": ServedAs("int8", "fp16", "int8"),
    # Blocks of 32 keep those outliers in their own blocks: down_proj in 4 bits too. The head stays
    # 8-bit (the GGUF's is Q8_0; in 4 bits: +4% perplexity, bench/quality.py).
    "int4": ServedAs("int4", "int4", "q8"),
}


def served_as(quantize: str) -> ServedAs:
    if quantize not in _SERVED_AS:
        raise _unknown(quantize)
    return _SERVED_AS[quantize]


def _unknown(kind: str) -> QuantizeError:
    return QuantizeError(f"unknown quantization {kind!r}; choose one of {', '.join(QUANTIZE_CHOICES)}")


# Served forms whose rows an embedding reads as they are (`rows(ids)`); any other table is float.
ROW_FORMATS = (Q8Weight, Q6Weight)


def has_rows(weight) -> bool:
    """Whether `weight` (float, or a packed form) is a table an embedding can look rows up in."""
    return isinstance(weight, (torch.Tensor, *ROW_FORMATS))


def embedding_rows(table, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of an embedding table (float, or 8- or 6-bit blocks): [n, hidden]."""
    return table.rows(ids) if isinstance(table, ROW_FORMATS) else F.embedding(ids, table)


def is_packed(weight) -> bool:
    """Whether `weight` is a packed form, whose rows come out the same at any batch
    (tpserve/kernels/int8_linear.py): such products need no row tiles."""
    return isinstance(weight, PackedWeight)


def held_bytes(weight) -> int:
    """The bytes a served weight holds: a packed form's own count, else the tensor's."""
    return weight.nbytes if is_packed(weight) else weight.numel() * weight.element_size()


_KINDS = {"int8": Int8Weight, "fp16": Fp16Weight, "int4": Q4Weight, "q8": Q8Weight}
_FAST_Q4_PATHS = ("avx2", "avx512_vnni")


def quantize_weight(weight: torch.Tensor, kind: str):
    """`weight` packed as `kind` ("int8", "fp16", "int4" or "q8"), or itself for "none"."""
    if kind == "none" or weight.numel() == 0:  # a piece holding no KV head has an empty q/k/v
        return weight
    if kind not in _KINDS:
        raise _unknown(kind)
    if kind in ("int4", "q8") and weight.shape[1] % BLOCK:
        # A row-parallel piece whose input is not whole blocks (a small model's 3 heads of 16), or
        # a model whose hidden size is not (its head)
        log.info("a %s weight's input is not whole blocks of %d: served in int8", list(weight.shape), BLOCK)
        kind = "int8"
    return _KINDS[kind](weight)


def quantize_unavailable(kind: str, device: torch.device | str) -> str | None:
    """None where weights in `kind` run on `device`; else why not, in words."""
    if kind == "int8":
        return int8_available(device)
    if kind == "int4":
        if torch.device(device).type != "cpu":
            return f"int4 weights run on CPUs (our C kernel), not on {torch.device(device).type}"
        # a GGUF's own 5- and 6-bit blocks and MXFP4 experts are served by kernels of their own
        return q4_available() or q8_available() or q5_available() or q6_available() or mxfp4_available()
    return None


def auto_quantize(device: torch.device | str) -> str:
    if quantize_unavailable("int4", device) is None and any(p in supported_paths() for p in _FAST_Q4_PATHS):
        return "int4"
    return "int8" if int8_available(device) is None else "none"
