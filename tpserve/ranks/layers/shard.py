"""What a rank's layer objects are built from: the config, this rank's weights and pieces, the formats
they are served in, the row tile of batch-invariant products and the rank's group."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tpserve.kernels.tensor_parallel import RankGroup
from tpserve.kernels.weight_formats import ServedAs, served_as
from tpserve.ranks.model_config import ModelConfig
from tpserve.ranks.sharding import Piece
from tpserve.ranks.weights import RankWeights


@dataclass
class Shard:
    config: ModelConfig
    weights: RankWeights
    pieces: list[Piece]
    quantize: str  # the formats' choice (tpserve/kernels/weight_formats.py)
    row_tile: int  # see tpserve/kernels/linear.py: batch-invariant products (0: plain ones)
    group: RankGroup

    @property
    def dtype(self) -> torch.dtype:
        return self.weights.dtype

    @property
    def device(self) -> torch.device:
        return next(iter(self.weights.replicated.values())).device

    @property
    def formats(self) -> ServedAs:
        return served_as(self.quantize)

    def replicated(self, name: str) -> torch.Tensor:
        """A weight every rank holds whole (norms, routers, sinks, biases added after a reduce)."""
        return self.weights.replicated[name]

    def layer_name(self, index: int, leaf: str) -> str:
        return f"model.layers.{index}.{leaf}"
