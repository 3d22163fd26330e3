"""Checkpoints that store q/k/v or gate/up as one tensor (Phi-3's qkv_proj and gate_up_proj).

Each part is read as a range of the fused tensor's rows, so the sharding table cuts its pieces out
exactly as from separate q/k/v and gate/up tensors: the same pieces, the same products, the same
bits at tp=1 and tp=2.
"""

from __future__ import annotations

import re

from tpserve.ranks.errors import ModelFileError
from tpserve.ranks.model_config import ModelConfig

# A part's name (after "model.layers.N.") -> (the fused tensor's name, the part's place in it).
FUSED_PARTS = {
    "self_attn.q_proj.weight": ("self_attn.qkv_proj.weight", 0),
    "self_attn.k_proj.weight": ("self_attn.qkv_proj.weight", 1),
    "self_attn.v_proj.weight": ("self_attn.qkv_proj.weight", 2),
    "mlp.gate_proj.weight": ("mlp.gate_up_proj.weight", 0),
    "mlp.up_proj.weight": ("mlp.gate_up_proj.weight", 1),
}
_LAYER_NAME = re.compile(r"^(model\.layers\.\d+\.)(.+)$")


def fused_part(config: ModelConfig, name: str) -> tuple[str, int, int, int] | None:
    """(the fused tensor holding `name`, its first row, its number of rows, the fused tensor's
    rows), or None where `name` is no part of a fused tensor."""
    match = _LAYER_NAME.match(name)
    if match is None or match.group(2) not in FUSED_PARTS:
        return None
    whole, place = FUSED_PARTS[match.group(2)]
    if whole.startswith("self_attn."):
        q_width = config.num_heads * config.head_dim
        kv_width = config.num_kv_heads * config.head_dim
        sizes = (q_width, kv_width, kv_width)
    else:
        sizes = (config.intermediate_size, config.intermediate_size)
    return match.group(1) + whole, sum(sizes[:place]), sizes[place], sum(sizes)


class StoredRows:
    """Rows [first, first + num_rows) of a stored tensor, read as a tensor of their own."""

    def __init__(self, whole, name: str, first: int, num_rows: int, total_rows: int):
        if whole.shape[0] != total_rows:
            raise ModelFileError(
                whole.path, f"fused tensor {name} has {whole.shape[0]} rows, config.json implies {total_rows}"
            )
        self._whole, self._first = whole, first
        self.path = whole.path
        self.shape = (num_rows, *whole.shape[1:])

    def read(self, start: int = 0, end: int | None = None, columns: bool = False):
        """Rows [start, end) of the part (every row by default). A fused part is cut by rows only:
        q/k/v and gate/up are column-parallel."""
        if columns:
            raise ValueError("a fused tensor's part is cut by rows, not columns")
        end = self.shape[0] if end is None else end
        return self._whole.read(self._first + start, self._first + end)
