"""A GGUF tensor's own blocks, unpacked: what `import-gguf` keeps for Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K,
Q6_K, Q8_0 and MXFP4 weights.

Each block holds 32 consecutive inputs of one output row. Written out in torch layout:
    q: [out, in] uint8 values 0..15 (4-bit) or 0..31 (5-bit), or int8 values (8-bit), one byte each
    d: [out, in / 32] float16 (float32 for Q4_K and Q5_K), and for 4 and 5 bits m likewise
with weight = d * q + m (Q4_1, Q5_1), d * (q - 8) = d * q + (-8 d) (Q4_0, written with m = -8 d,
exact in float16; Q5_0 likewise with m = -16 d), d * q (Q8_0). Q4_K's and Q5_K's super-block of 256
inputs holds 8 blocks of 32, each with 6-bit sc and mn beside the super-block's float16 d and dmin:
weight = (d sc) q - dmin mn, so its blocks are d = d sc and m = -dmin mn, exact in float32 (11
significant bits times 6) though not in float16. They dequantize exactly to what the `gguf`
package's dequantize gives (Q4_0's and Q5_0's zeros aside: +0.0 where gguf gives -0.0), and the
engine serves them as they are (tpserve/kernels/q4_linear.py, tpserve/kernels/q5_linear.py,
tpserve/kernels/q8_linear.py), so nothing is rounded twice.

Q6_K's super-block of 256 inputs holds 16 int8 sub-scales sc (one per 16 inputs), 6-bit values q
(a low nibble and 2 high bits each) and a float16 d: weight = d * sc * (q - 32), each exact in
float32 (11 significant bits times 7 times 5). It is written as
    q6: [out, in] uint8 values 0..63, sc: [out, in / 16] int8, d: [out, in / 256] float16
and served by its own kernel (tpserve/kernels/q6_linear.py). Q3_K's super-block has the same shape, 3-bit
values v in -4..3 and 6-bit sub-scales s in 0..63: weight = d * (s - 32) * v, written as six-bit
blocks q = v + 32, sc = s - 32 (exact; 0.875 bytes a weight served, against the GGUF's 0.43). Q2_K
is not kept: its 16 inputs share a scale and a minimum, which no kernel here takes; it is
dequantized to float32 (and quantized again at load where the format asks for it). MXFP4
(gpt-oss's experts) is written as its codes and scale bytes, as tpserve/ranks/mxfp4.py reads the HF
checkpoints' (tpserve/ranks/block_tensors.py):
    q: [out, in] uint8 e2m1 codes 0..15, a byte each, d: [out, in / 32] uint8 e8m0 scale bytes
"""

from __future__ import annotations

from dataclasses import dataclass

import gguf
import numpy as np
import torch

from tpserve.kernels.block_weights import BLOCK
from tpserve.kernels.mxfp4_linear import dequantize_codes
from tpserve.ranks.block_tensors import MXFP4, SUFFIXES

SUPER_BLOCK = 256  # a K-quant's inputs per super-block: 8 blocks
SUB_BLOCK = 16  # Q6_K's inputs per sub-scale
_Q = gguf.GGMLQuantizationType
KEPT_TYPES = frozenset(
    {_Q.Q3_K, _Q.Q4_0, _Q.Q4_1, _Q.Q4_K, _Q.Q5_0, _Q.Q5_1, _Q.Q5_K, _Q.Q6_K, _Q.Q8_0, _Q.MXFP4}
)
# float16, or float32 for Q4_K and Q5_K
SCALE_BYTES = {_Q.Q4_0: 2, _Q.Q4_1: 2, _Q.Q4_K: 4, _Q.Q5_0: 2, _Q.Q5_1: 2, _Q.Q5_K: 4, _Q.Q8_0: 2}


def kept_bytes(qtype, num_values: int) -> int:
    """The bytes a kept tensor of `num_values` weights is written in: one a value, then two scales a
    block (Q6_K and Q3_K: an int8 a sub-block and a float16 a super-block; MXFP4: a scale byte)."""
    if qtype in (_Q.Q6_K, _Q.Q3_K):
        return num_values + num_values // SUB_BLOCK + num_values // SUPER_BLOCK * 2
    if qtype == _Q.MXFP4:
        return num_values + num_values // BLOCK
    return num_values + num_values // BLOCK * 2 * SCALE_BYTES[qtype]


@dataclass(frozen=True)
class Blocks:
    q: np.ndarray  # [out, in] uint8 (4- and 5-bit, MXFP4's codes) or int8 (8-bit)
    d: np.ndarray  # [out, in / 32] float16 (float32 for Q4_K and Q5_K; MXFP4's uint8 scale bytes)
    m: np.ndarray | None  # [out, in / 32] as d; None for 8 bits and MXFP4
    bits: int | str = 4  # 4, 5, 8 or MXFP4: what the values are written under (block_tensors.SUFFIXES)

    def dequantize(self) -> np.ndarray:
        if self.bits == MXFP4:
            return dequantize_codes(torch.from_numpy(self.q), torch.from_numpy(self.d)).numpy()
        d = self.d.astype(np.float32)[..., None]
        values = self.q.reshape(*self.d.shape, BLOCK).astype(np.float32) * d
        if self.m is not None:
            values += self.m.astype(np.float32)[..., None]
        return values.reshape(self.q.shape)

    def rows(self, order: np.ndarray) -> Blocks:
        """The same blocks with their output rows reordered (llama.cpp's q/k permutation undone)."""
        return Blocks(self.q[order], self.d[order], None if self.m is None else self.m[order], self.bits)

    def arrays(self, name: str) -> dict[str, np.ndarray]:
        """What the import writes for weight `name`, by safetensors name."""
        scales = f"{name}_e8m0" if self.bits == MXFP4 else f"{name}_d"
        arrays = {name + SUFFIXES[self.bits]: self.q, scales: self.d}
        if self.m is not None:
            arrays[f"{name}_m"] = self.m
        return arrays


@dataclass(frozen=True)
class SixBitBlocks:
    """A Q6_K tensor's values and scales: weight = d * sc * (q - 32)."""

    q: np.ndarray  # [out, in] uint8 0..63
    sc: np.ndarray  # [out, in / 16] int8
    d: np.ndarray  # [out, in / 256] float16

    bits = 6

    def dequantize(self) -> np.ndarray:
        # (d * sc) * (q - 32) in float32 as gguf computes it; every product is exact anyway.
        step = np.repeat(self.d.astype(np.float32), SUPER_BLOCK // SUB_BLOCK, axis=1) * self.sc
        values = (self.q.reshape(*self.sc.shape, SUB_BLOCK).astype(np.float32) - 32) * step[..., None]
        return values.reshape(self.q.shape)

    def rows(self, order: np.ndarray) -> SixBitBlocks:
        return SixBitBlocks(self.q[order], self.sc[order], self.d[order])

    def arrays(self, name: str) -> dict[str, np.ndarray]:
        return {f"{name}_q6": self.q, f"{name}_sc": self.sc, f"{name}_d": self.d}


def read_blocks(data: np.ndarray, qtype, shape: tuple[int, int]) -> Blocks | SixBitBlocks:
    """data: the tensor's raw bytes [out, bytes per row] (gguf.ReaderTensor.data); shape: [out, in]."""
    num_out, num_in = shape
    if qtype == _Q.Q4_K:
        return _read_q4_k(data, num_out, num_in)
    if qtype == _Q.Q6_K:
        return _read_q6_k(data, num_out, num_in)
    if qtype == _Q.Q3_K:
        return _read_q3_k(data, num_out, num_in)
    if qtype == _Q.Q5_K:
        return _read_q5_k(data, num_out, num_in)
    if qtype == _Q.MXFP4:
        return read_mxfp4(data, num_out, num_in)
    raw = np.ascontiguousarray(data).reshape(num_out, num_in // BLOCK, -1)
    d = raw[..., 0:2].copy().view(np.float16)[..., 0]
    if qtype == _Q.Q8_0:
        q = raw[..., 2:34].copy().view(np.int8).reshape(num_out, num_in)
        return Blocks(q, d, None, bits=8)
    asymmetric = qtype in (_Q.Q4_1, _Q.Q5_1)
    at = 4 if asymmetric else 2  # the values' (Q5: their high bits') first byte
    m = raw[..., 2:4].copy().view(np.float16)[..., 0] if asymmetric else None
    if qtype in (_Q.Q4_0, _Q.Q4_1):
        m = (-8 * d).astype(np.float16) if m is None else m
        return Blocks(_nibbles(raw[..., at : at + 16]).reshape(num_out, num_in), d, m)
    # Q5_0, Q5_1: bit j of the 4 bytes (a little-endian uint32) is value j's fifth bit.
    high = raw[..., at : at + 4].copy().view("<u4") >> np.arange(32, dtype=np.uint32)
    q = _nibbles(raw[..., at + 4 : at + 20]) | ((high & 1).astype(np.uint8) << 4)
    m = (-16 * d).astype(np.float16) if m is None else m
    return Blocks(q.reshape(num_out, num_in), d, m, bits=5)


def read_mxfp4(data: np.ndarray, num_out: int, num_in: int) -> Blocks:
    """MXFP4's codes and scale bytes, as stored: a block's 17 bytes are an e8m0 scale byte (2^(e -
    127); 255, NaN, is refused by the import) and 16 bytes whose byte j holds code j (low nibble)
    and code j + 16 (high)."""
    raw = np.ascontiguousarray(data).reshape(num_out, num_in // BLOCK, 17)
    return Blocks(_nibbles(raw[..., 1:]).reshape(num_out, num_in), raw[..., 0].copy(), None, bits=MXFP4)


def _nibbles(packed: np.ndarray) -> np.ndarray:
    """[..., 16] bytes -> [..., 32] values: value j (< 16) is byte j's low nibble, value j + 16 its high."""
    return np.concatenate((packed & 15, packed >> 4), axis=-1)


def _read_q4_k(data: np.ndarray, num_out: int, num_in: int) -> Blocks:
    # A super-block's 144 bytes: d and dmin (float16), 12 bytes of sc and mn (6 bits each, 8 of
    # each), then 128 bytes of nibbles.
    raw = np.ascontiguousarray(data).reshape(num_out, num_in // SUPER_BLOCK, 144)
    return _k_blocks(raw, _k_nibbles(raw[..., 16:]).reshape(num_out, num_in), bits=4)


def _read_q3_k(data: np.ndarray, num_out: int, num_in: int) -> SixBitBlocks:
    # A super-block's 110 bytes: 32 of high bits, 64 of 2-bit pairs, 12 of 6-bit scales, float16 d.
    # Input 128 n + 32 k + l (n < 2, k < 4, l < 32) is the bit pair k of byte 32 n + l and bit
    # 4 n + k of high byte l, v = pair - 4 where that bit is clear (gguf's dequantize_blocks); scale
    # s (< 16) has its low 4 bits in the nibble s // 8 of byte s % 8 and its top 2 in bits
    # 2 (s // 4), + 1 of byte 8 + s % 4.
    raw = np.ascontiguousarray(data).reshape(num_out, num_in // SUPER_BLOCK, 110)
    high = raw[..., :32].reshape(num_out, -1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(8, 1)
    pairs = raw[..., 32:96].reshape(num_out, -1, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(4, 1)
    v = (pairs & 3).reshape(num_out, -1, 8, 32).astype(np.int8) - 4 * (1 - (high & 1)).astype(np.int8)
    low = raw[..., 96:104].reshape(num_out, -1, 1, 8) >> np.array([0, 4], np.uint8).reshape(2, 1)
    top = raw[..., 104:108].reshape(num_out, -1, 1, 4) >> np.array([0, 2, 4, 6], np.uint8).reshape(4, 1)
    s = (low.reshape(num_out, -1, 16) & 15) | ((top.reshape(num_out, -1, 16) & 3) << 4)
    q = (v.reshape(num_out, num_in) + 32).astype(np.uint8)
    sc = (s.astype(np.int8) - 32).reshape(num_out, num_in // SUB_BLOCK)
    d = raw[..., 108:110].copy().view(np.float16).reshape(num_out, num_in // SUPER_BLOCK)
    return SixBitBlocks(q, sc, d)


def _read_q5_k(data: np.ndarray, num_out: int, num_in: int) -> Blocks:
    # A super-block's 176 bytes: as Q4_K's, with 32 bytes of fifth bits before the nibbles: bit j of
    # byte l is block j's value l's.
    raw = np.ascontiguousarray(data).reshape(num_out, num_in // SUPER_BLOCK, 176)
    high = raw[..., 16:48].reshape(num_out, -1, 1, BLOCK) >> np.arange(8, dtype=np.uint8).reshape(8, 1)
    q = _k_nibbles(raw[..., 48:]) | ((high & 1) << 4)
    return _k_blocks(raw, q.reshape(num_out, num_in), bits=5)


def _k_nibbles(packed: np.ndarray) -> np.ndarray:
    """A Q4_K or Q5_K super-block's 128 bytes of nibbles [..., 128] -> [..., 8, 32]: blocks 2c and
    2c + 1 are the low and the high nibbles of bytes 32c .. 32c + 31."""
    packed = packed.reshape(*packed.shape[:-1], 4, 1, BLOCK)
    return np.concatenate((packed & 15, packed >> 4), axis=-2).reshape(*packed.shape[:-3], 8, BLOCK)


def _k_blocks(raw: np.ndarray, q: np.ndarray, bits: int) -> Blocks:
    """Q4_K's or Q5_K's blocks of 32: raw [out, supers, bytes] starts with d, dmin and the 6-bit sc
    and mn; q [out, in] are the values."""
    num_out = raw.shape[0]
    d = raw[..., 0:2].copy().view(np.float16).astype(np.float32)  # [out, supers, 1]
    dmin = raw[..., 2:4].copy().view(np.float16).astype(np.float32)
    sc, mn = _six_bit_scales(raw[..., 4:16])  # [out, supers, 8] each
    # float32 products of an 11-bit significand and a 6-bit integer: exact, as gguf computes them.
    block_d = (d * sc.astype(np.float32)).reshape(num_out, -1)
    block_m = -(dmin * mn.astype(np.float32)).reshape(num_out, -1)
    return Blocks(q, block_d, block_m, bits)


def _read_q6_k(data: np.ndarray, num_out: int, num_in: int) -> SixBitBlocks:
    # A super-block's 210 bytes: 128 of low nibbles, 64 of high 2-bit pairs, 16 int8 sc, float16 d.
    # Input 128 n + 32 k + l (n < 2, k < 4, l < 32) is the nibble (k // 2) of low byte
    # 64 n + 32 (k % 2) + l and the bit pair k of high byte 32 n + l (gguf's dequantize_blocks).
    raw = np.ascontiguousarray(data).reshape(num_out, num_in // SUPER_BLOCK, 210)
    low = raw[..., :128].reshape(num_out, -1, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(2, 1)
    low = (low & 15).reshape(num_out, -1, 2, 4, 32)
    high = raw[..., 128:192].reshape(num_out, -1, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(4, 1)
    q = (low | ((high & 3) << 4)).reshape(num_out, num_in)
    sc = raw[..., 192:208].copy().view(np.int8).reshape(num_out, num_in // SUB_BLOCK)
    d = raw[..., 208:210].copy().view(np.float16).reshape(num_out, num_in // SUPER_BLOCK)
    return SixBitBlocks(q, sc, d)


def _six_bit_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """packed: [..., 12] bytes -> sc, mn [..., 8] in 0..63 (llama.cpp's get_scale_min_k4).

    Blocks 0..3 have sc in the low 6 bits of bytes 0..3 and mn in those of bytes 4..7; blocks
    4..7 have their low 4 bits in bytes 8..11 (sc low nibble, mn high nibble) and their top 2 bits
    in the top 2 bits of bytes 0..3 (sc) and 4..7 (mn)."""
    first, second, low = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    sc = np.concatenate((first & 63, (low & 15) | ((first >> 6) << 4)), axis=-1)
    mn = np.concatenate((second & 63, (low >> 4) | ((second >> 6) << 4)), axis=-1)
    return sc, mn
