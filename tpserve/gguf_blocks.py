"""A GGUF tensor's own blocks, unpacked: what `import-gguf` keeps for Q4_0, Q4_1 and Q8_0 weights.

Each block holds 32 consecutive inputs of one output row. Written out in torch layout:
    q: [out, in] uint8 values 0..15 (4-bit) or int8 values (8-bit), one byte each
    d: [out, in / 32] float16, and for 4 bits m: [out, in / 32] float16
with weight = d * q + m (Q4_1), d * (q - 8) = d * q + (-8 d) (Q4_0, written with m = -8 d, exact in
float16), d * q (Q8_0). They dequantize exactly to what the `gguf` package's dequantize gives, and
the engine serves them as they are (kernels/q4_linear.py), so nothing is rounded twice.
"""

from __future__ import annotations

from dataclasses import dataclass

import gguf
import numpy as np

BLOCK = 32
_Q = gguf.GGMLQuantizationType
KEPT_TYPES = frozenset({_Q.Q4_0, _Q.Q4_1, _Q.Q8_0})


@dataclass(frozen=True)
class Blocks:
    q: np.ndarray  # [out, in] uint8 (4-bit) or int8 (8-bit)
    d: np.ndarray  # [out, in / 32] float16
    m: np.ndarray | None  # [out, in / 32] float16; None for 8 bits

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
