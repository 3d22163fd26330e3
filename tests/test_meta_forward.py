"""Every model variant's forward pass on the `meta` device, at tp 1 and on both ranks of tp 2.

A meta tensor has a shape and a device but no data, so a pass that creates a tensor on the CPU
instead of the model's device, or reads a value back to the host in the middle of a pass (an
`.item()`, a `.tolist()`, a Python `if` on a tensor), fails here as it would stall or fail on a
GPU. The weights are loaded through the real loader onto the meta device.
"""

from __future__ import annotations

import pytest
import torch
from tiny_models import VARIANTS, write_tiny_model

from tpserve.kernels.attention import SpanView
from tpserve.kernels.linear import ROW_TILE
from tpserve.ranks.kv_store import KVPool
from tpserve.ranks.loader import load_rank_model
from tpserve.ranks.model_config import load_model_config

META = torch.device("meta")


class MetaCollectives:
    """The two forward collectives with the shapes of the real ones and no data to exchange."""

    def __init__(self, rank: int, world_size: int):
        self.rank, self.world_size = rank, world_size
        self.calls: list[str] = []

    def all_reduce_sum(self, x: torch.Tensor) -> torch.Tensor:
        assert x.device == META and x.dtype == torch.float32, (x.device, x.dtype)
        self.calls.append("all_reduce")
        return x

    def gather_to_first(self, x: torch.Tensor) -> list[torch.Tensor] | None:
        assert x.device == META, x.device
        self.calls.append("gather")
        return [torch.empty_like(x) for _ in range(self.world_size)] if self.rank == 0 else None


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("meta")
    return {variant: str(write_tiny_model(root / variant, variant)) for variant in VARIANTS}


@pytest.mark.parametrize("row_tile", [0, ROW_TILE], ids=["fast", "invariant"])
@pytest.mark.parametrize(
    ("tp_size", "tp_rank"), [(1, 0), (2, 0), (2, 1)], ids=["tp1", "tp2-rank0", "tp2-rank1"]
)
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_every_variant_runs_a_prefill_and_a_decode_step_on_the_models_device(
    model_dirs, variant, tp_size, tp_rank, row_tile
):
    config = load_model_config(model_dirs[variant])
    collectives = MetaCollectives(tp_rank, tp_size) if tp_size > 1 else None
    model = load_rank_model(
        model_dirs[variant],
        tp_rank=tp_rank,
        tp_size=tp_size,
        dtype=torch.bfloat16,
        max_positions=64,
        collectives=collectives,
        row_tile=row_tile,
        device=META,
    )
    kv = KVPool(config.num_layers, 64, model.kv_heads_per_piece(), config.head_dim, torch.bfloat16, META)

    # Two prompts prefilled together (5 and 3 tokens), then one decode step for each.
    prefill = [SpanView(0, 0, 5, tuple(range(5))), SpanView(5, 0, 3, tuple(range(32, 35)))]
    logits = model.forward(
        torch.zeros(8, dtype=torch.int64, device=META),
        torch.tensor([0, 1, 2, 3, 4, 0, 1, 2], device=META),
        prefill,
        kv,
        [4, 7],
    )
    decode = [SpanView(0, 5, 1, tuple(range(6))), SpanView(1, 3, 1, tuple(range(32, 36)))]
    step = model.forward(
        torch.zeros(2, dtype=torch.int64, device=META), torch.tensor([5, 3], device=META), decode, kv, [0, 1]
    )

    for out in (logits, step):
        if tp_rank == 0:
            assert out.device == META and out.dtype == torch.float32
            assert tuple(out.shape) == (2, config.vocab_size)
        else:
            assert out is None  # logits reach rank 0 only
    if tp_size > 1:
        # Per pass: the embedding, two reductions per layer, and the logits gather.
        per_pass = ["all_reduce"] * (1 + 2 * config.num_layers) + ["gather"]
        assert collectives.calls == per_pass * 2
