"""A GGUF tensor's own blocks, unpacked: what `import-gguf` keeps for Q4_0, Q4_1, Q4_K and Q8_0 weights.

Each block holds 32 consecutive inputs of one output row. Written out in torch layout:
    q: [out, in] uint8 values 0..15 (4-bit) or int8 values (8-bit), one byte each
    d: [out, in / 32] float16 (float32 for Q4_K), and for 4 bits m: [out, in / 32] likewise
with weight = d * q + m (Q4_1), d * (q - 8) = d * q + (-8 d) (Q4_0, written with m = -8 d, exact in
float16), d * q (Q8_0). Q4_K's super-block of 256 inputs holds 8 blocks of 32, each with 6-bit sc
and mn beside the super-block's float16 d and dmin: weight = (d sc) q - dmin mn, so its blocks are
d = d sc and m = -dmin mn, exact in float32 (11 significant bits times 6) though not in float16.
They dequantize exactly to what the `gguf` package's dequantize gives, and the engine serves them as
they are (kernels/q4_linear.py), so nothing is rounded twice.

Q6_K is not kept: its scales are per 16 inputs (an int8 each), and two halves of a block of 32 may
have different ones, so it does not fit blocks of 32 with one scale; it is dequantized to float32.
"""

from __future__ import annotations

from dataclasses import dataclass

import gguf
import numpy as np

from tpserve.kernels.block_weights import BLOCK

SUPER_BLOCK = 256  # Q4_K's inputs per super-block: 8 blocks
_Q = gguf.GGMLQuantizationType
KEPT_TYPES = frozenset({_Q.Q4_0, _Q.Q4_1, _Q.Q4_K, _Q.Q8_0})
SCALE_BYTES = {_Q.Q4_0: 2, _Q.Q4_1: 2, _Q.Q4_K: 4, _Q.Q8_0: 2}  # float16, or float32 for Q4_K


def kept_bytes(qtype, num_values: int) -> int:
    """The bytes a kept tensor of `num_values` weights is written in: one a value, two scales a block."""
    return num_values + num_values // BLOCK * 2 * SCALE_BYTES[qtype]


@dataclass(frozen=True)
class Blocks:
    q: np.ndarray  # [out, in] uint8 (4-bit) or int8 (8-bit)
    d: np.ndarray  # [out, in / 32] float16 (float32 for Q4_K)
    m: np.ndarray | None  # [out, in / 32] as d; None for 8 bits

    @property
    def bits(self) -> int:
        return 8 if self.m is None else 4

    def dequantize(self) -> np.ndarray:
        d = self.d.astype(np.float32)[..., None]
        values = self.q.reshape(*self.d.shape, BLOCK).astype(np.float32) * d
        if self.m is not None:
            values += self.m.astype(np.float32)[..., None]
        return values.reshape(self.q.shape)

    def rows(self, order: np.ndarray) -> Blocks:
        """The same blocks with their output rows reordered (llama.cpp's q/k permutation undone)."""
        return Blocks(self.q[order], self.d[order], None if self.m is None else self.m[order])


def read_blocks(data: np.ndarray, qtype, shape: tuple[int, int]) -> Blocks:
    """data: the tensor's raw bytes [out, bytes per row] (gguf.ReaderTensor.data); shape: [out, in]."""
    num_out, num_in = shape
    if qtype == _Q.Q4_K:
        return _read_q4_k(data, num_out, num_in)
    raw = np.ascontiguousarray(data).reshape(num_out, num_in // BLOCK, -1)
    d = raw[..., 0:2].copy().view(np.float16)[..., 0]
    if qtype == _Q.Q8_0:
        q = raw[..., 2:34].copy().view(np.int8).reshape(num_out, num_in)
        return Blocks(q, d, None)
    packed = raw[..., 4:20] if qtype == _Q.Q4_1 else raw[..., 2:18]
    # value j (< 16) is byte j's low nibble, value j + 16 its high nibble
    q = np.concatenate((packed & 15, packed >> 4), axis=-1).reshape(num_out, num_in)
    m = raw[..., 2:4].copy().view(np.float16)[..., 0] if qtype == _Q.Q4_1 else (-8 * d).astype(np.float16)
    return Blocks(q, d, m)


def _read_q4_k(data: np.ndarray, num_out: int, num_in: int) -> Blocks:
    # A super-block's 144 bytes: d and dmin (float16), 12 bytes of sc and mn (6 bits each, 8 of
    # each), then 128 bytes of nibbles.
    raw = np.ascontiguousarray(data).reshape(num_out, num_in // SUPER_BLOCK, 144)
    d = raw[..., 0:2].copy().view(np.float16).astype(np.float32)  # [out, supers, 1]
    dmin = raw[..., 2:4].copy().view(np.float16).astype(np.float32)
    sc, mn = _six_bit_scales(raw[..., 4:16])  # [out, supers, 8] each
    # Blocks 2c and 2c + 1 are the low and the high nibbles of bytes 32c .. 32c + 31.
    packed = raw[..., 16:].reshape(num_out, -1, 4, 1, BLOCK)
    q = np.concatenate((packed & 15, packed >> 4), axis=-2).reshape(num_out, num_in)
    # float32 products of an 11-bit significand and a 6-bit integer: exact, as gguf computes them.
    block_d = (d * sc.astype(np.float32)).reshape(num_out, -1)
    block_m = -(dmin * mn.astype(np.float32)).reshape(num_out, -1)
    return Blocks(q, block_d, block_m)


def _six_bit_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """packed: [..., 12] bytes -> sc, mn [..., 8] in 0..63 (llama.cpp's get_scale_min_k4).

    Blocks 0..3 have sc in the low 6 bits of bytes 0..3 and mn in those of bytes 4..7; blocks
    4..7 have their low 4 bits in bytes 8..11 (sc low nibble, mn high nibble) and their top 2 bits
    in the top 2 bits of bytes 0..3 (sc) and 4..7 (mn)."""
    first, second, low = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    sc = np.concatenate((first & 63, (low & 15) | ((first >> 6) << 4)), axis=-1)
    mn = np.concatenate((second & 63, (low >> 4) | ((second >> 6) << 4)), axis=-1)
    return sc, mn
