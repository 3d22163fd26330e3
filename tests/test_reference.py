"""Our model against an independent implementation (Hugging Face transformers) on the same files."""

from __future__ import annotations

import pytest
import torch
from engine_lanes import open_lane
from tiny_models import VARIANTS, write_tiny_model

from tpserve.kernels.attention_kernels import NATIVE, SPANS, TILED
from tpserve.kernels.linear import ROW_TILE
from tpserve.kernels.native_attention import native_unavailable
from tpserve.ranks.engine import Engine
from tpserve.ranks.kv_store import KVPool
from tpserve.ranks.loader import load_rank_model

transformers = pytest.importorskip("transformers")


# Each attention kernel: SDPA span by span (batch_invariant off), the C kernel (on, on a CPU) and
# the tiled products (on, where no C kernel builds).
KERNELS = {"spans": (SPANS, 0), "native": (NATIVE, ROW_TILE), "tiled": (TILED, ROW_TILE)}


@pytest.mark.parametrize("kernel", sorted(KERNELS))
@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.float16], ids=["kv-float32", "kv-float16"])
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_logits_match_transformers(tmp_path, variant, kernel, pool_dtype):
    model_dir = write_tiny_model(tmp_path / variant, variant)
    torch.set_num_threads(1)
    model = load_rank_model(
        model_dir, tp_rank=0, tp_size=1, dtype=torch.float32, max_positions=256, row_tile=KERNELS[kernel][1]
    )
    if kernel == "native" and (why := native_unavailable(16, 2, torch.float32, "cpu")):
        pytest.skip(why)
    model.attention = KERNELS[kernel][0]
    engine = Engine(
        model,
        KVPool(model.config.num_layers, 128, model.kv_heads_per_piece(), model.config.head_dim, pool_dtype),
    )
    ids = [(7 * i + 3) % model.config.vocab_size for i in range(90)]
    open_lane(engine, 0, 100)
    # A prompt in two chunks, then two decode steps: every path that writes and reads the KV.
    ours = [engine.forward([(0, 0, tuple(ids[:50]))]), engine.forward([(0, 50, tuple(ids[50:88]))])]
    ours += [engine.forward([(0, 88, (ids[88],))]), engine.forward([(0, 89, (ids[89],))])]
    reference = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        expected = reference(torch.tensor([ids])).logits[0]
    # A float16 pool (kv_dtype auto's on a CPU) rounds each key and value once, to 11 bits: within
    # 1% of the logits' scale (a misread key or value moves them by the scale itself).
    for got, row in zip(ours, (49, 87, 88, 89)):
        if pool_dtype == torch.float32:
            torch.testing.assert_close(got[0], expected[row], rtol=1e-4, atol=1e-4)
        else:
            scale = float(expected[row].abs().max())
            torch.testing.assert_close(got[0], expected[row], rtol=1e-2, atol=1e-2 * scale)
