"""gpt-oss's experts, stored stacked, read as one expert's projection at a time.

transformers writes every layer's experts as `mlp.experts.gate_up_proj` [E, hidden, 2I] (the input
first; gate and up columns interleaved: gate j is column 2j, up j column 2j + 1), `down_proj`
[E, I, hidden] and their biases `gate_up_proj_bias` [E, 2I], `down_proj_bias` [E, hidden]. The real
checkpoints keep the two products in MXFP4 instead (tpserve/ranks/mxfp4.py): `gate_up_proj_blocks`
[E, 2I, hidden / 32, 16] with `_scales` [E, 2I, hidden / 32], `down_proj_blocks` [E, hidden, I / 32,
16] with `_scales`, the output first. Either way each expert's gate, up and down (and the gate and
up biases) are read here as the [out, in] tensors other families store (`experts.N.gate_proj.weight`
...), so the sharding table cuts their pieces as it cuts Qwen3-MoE's: the same pieces, the same
products, the same bits at tp=1 and tp=2. A piece's rows of gate or up are every other stored row
of its range; its columns of down the blocks that cover them. MXFP4 comes out as its own blocks
(tpserve/ranks/mxfp4.py), which `int4` serves as stored (tpserve/kernels/mxfp4_linear.py) and the
others dequantize exactly; a piece whose columns of down do not start and end on a block edge (a
tiny model's) gets their values instead.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from tpserve.ranks.block_tensors import BlockValues
from tpserve.ranks.errors import ModelFileError
from tpserve.ranks.model_config import ModelConfig
from tpserve.ranks.mxfp4 import BLOCK, dequantize_mxfp4, mxfp4_blocks

_PART = re.compile(
    r"^(model\.layers\.\d+\.mlp\.experts\.)(\d+)\.(gate_proj|up_proj|down_proj)\.(weight|bias)$"
)


def stacked_part(config: ModelConfig, name: str) -> re.Match | None:
    """`name`'s place among a stacked checkpoint's experts, None where the experts are not stacked
    or `name` is no expert's."""
    return _PART.match(name) if config.moe is not None and config.moe.stacked else None


class StoredExpertPart:
    """Expert `expert`'s gate, up or down projection, or its gate or up bias, as a tensor of its own:
    [I, hidden], [hidden, I] or [I]. `read` returns values in `dtype` (MXFP4 decoded exactly)."""

    def __init__(self, handles: dict, files: dict[str, Path], config: ModelConfig, match: re.Match, dtype):
        stem, leaf, kind = match.group(1), match.group(3), match.group(4)
        self.expert, self.dtype = int(match.group(2)), dtype
        self.down, self.offset = leaf == "down_proj", int(leaf == "up_proj")
        size, hidden, num_experts = config.moe.expert_size, config.hidden_size, config.moe.num_experts
        stored = stem + ("down_proj" if self.down else "gate_up_proj") + ("_bias" if kind == "bias" else "")
        self.shape = (size,) if kind == "bias" else (hidden, size) if self.down else (size, hidden)
        if stored in files:  # float, input first: [E, hidden, 2I] or [E, I, hidden]; a bias [E, 2I]
            self.mxfp4 = False
            implied = (2 * size,) if kind == "bias" else (size, hidden) if self.down else (hidden, 2 * size)
            parts = {stored: (num_experts, *implied)}
        elif stored + "_blocks" in files and stored + "_scales" in files:  # output first, in blocks
            self.mxfp4 = True
            rows, cols = (hidden, size) if self.down else (2 * size, hidden)
            if cols % BLOCK:
                raise ModelFileError(
                    files[stored + "_blocks"], f"MXFP4 {stored}: {cols} inputs are not whole blocks of 32"
                )
            parts = {
                stored + "_blocks": (num_experts, rows, cols // BLOCK, BLOCK // 2),
                stored + "_scales": (num_experts, rows, cols // BLOCK),
            }
        else:
            raise ModelFileError(
                next(iter(files.values())),
                f"checkpoint has no tensor {stored!r} (nor its MXFP4 _blocks and _scales)",
            )
        self._slices = []
        for part, implied in parts.items():
            tensor = handles[files[part]].get_slice(part)
            if tuple(tensor.get_shape()) != implied:
                raise ModelFileError(
                    files[part],
                    f"tensor {part} has shape {tensor.get_shape()}, config.json implies {list(implied)}",
                )
            self._slices.append(tensor)
        self.path, self.name = files[next(iter(parts))], stored
        self.where = f"{self.path}: {self.name}"  # how a refusal names it

    def read(
        self, start: int = 0, end: int | None = None, columns: bool = False
    ) -> torch.Tensor | BlockValues:
        """Rows [start, end) of gate or up (or a bias's entries), or columns [start, end) of down;
        everything by default."""
        e = self.expert
        if self.down:
            end = self.shape[1] if end is None else end
            if not self.mxfp4:  # [I, hidden] stored: its rows are down's columns
                return self._slices[0][e, start:end].t()
            first, last = start // BLOCK, -(-end // BLOCK)  # the blocks covering the columns
            blocks, scales = self._slices[0][e, :, first:last], self._slices[1][e, :, first:last]
            if start % BLOCK or end % BLOCK:
                kept = slice(start - first * BLOCK, end - first * BLOCK)
                return dequantize_mxfp4(blocks, scales, self.dtype, self.where)[:, kept]
            return mxfp4_blocks(blocks, scales, self.dtype, self.where)
        if columns:
            raise ValueError("an expert's gate or up is cut by rows, not columns")
        end = self.shape[0] if end is None else end
        if len(self.shape) == 1:  # a bias: gate and up entries interleaved
            return self._slices[0][e, 2 * start : 2 * end][self.offset :: 2]
        if not self.mxfp4:
            return self._slices[0][e, :, 2 * start : 2 * end][:, self.offset :: 2].t()
        stored = slice(2 * start, 2 * end)  # gate's (or up's) rows every other one of them
        blocks, scales = self._slices[0][e, stored], self._slices[1][e, stored]
        return mxfp4_blocks(blocks[self.offset :: 2], scales[self.offset :: 2], self.dtype, self.where)
