"""Decode rounds padded to graph buckets (tpserve/ranks/decode_graphs.py), run here eagerly as a GPU replays
them: the bucket a round takes, the padding rows confined to the spare block, the real rows' logits
the unpadded round's bit for bit; and greedy rows' ids taken where the logits are
(tpserve/kernels/device_sampling.py) equal to the host sampler's tokens."""

from __future__ import annotations

import pytest
import torch
from engine_lanes import open_lane, tiny_engine
from tiny_models import write_tiny_model

from tpserve.kernels.attention import SpanView
from tpserve.kernels.attention_kernels import paged_kernel
from tpserve.kernels.device_sampling import greedy_ids, greedy_on_device
from tpserve.kernels.sampling import sample
from tpserve.kernels.sampling_params import SamplingParams
from tpserve.ranks.decode_graphs import DECODE_BUCKETS, DecodeBuffers, DecodeGraph, bucket_for, padded_round
from tpserve.ranks.decode_runner import graphs_unfit
from tpserve.ranks.engine import Engine
from tpserve.ranks.kv_store import KVPool
from tpserve.ranks.lane_tables import EngineError
from tpserve.ranks.loader import load_rank_model

BLOCK_SIZE = 8


def test_a_round_takes_the_smallest_bucket_that_holds_it():
    assert [bucket_for(n) for n in (1, 2, 3, 4, 5, 9, 17, 32, 33, 200)] == [
        1,
        2,
        4,
        4,
        8,
        16,
        32,
        32,
        64,
        256,
    ]
    assert bucket_for(257) is None and bucket_for(20, largest=16) is None
    assert DECODE_BUCKETS[:6] == (1, 2, 4, 8, 16, 32)
    with pytest.raises(ValueError):
        bucket_for(0)


def test_padding_rows_write_and_read_only_the_spare_block():
    spans = [SpanView(0, 9, 1, (3, 5)), SpanView(1, 2, 1, (0,))]
    padded, ids, positions = padded_round(spans, [11, 12], [9, 2], 4, spare_block=7)
    assert padded[:2] == spans and [s.blocks for s in padded[2:]] == [(7,), (7,)]
    assert [(s.offset, s.start, s.length) for s in padded[2:]] == [(2, 0, 1), (3, 0, 1)]
    assert ids == [11, 12, 0, 0] and positions == [9, 2, 0, 0]
    with pytest.raises(ValueError, match="not spare"):
        padded_round(spans, [11, 12], [9, 2], 4, spare_block=5)
    buffers = DecodeBuffers(4, max_pages=8, block_size=BLOCK_SIZE, device="cpu")
    buffers.fill(padded, ids, positions, num_slots=8 * BLOCK_SIZE)
    assert buffers.slots.tolist() == [5 * 8 + 1, 0 * 8 + 2, 7 * 8, 7 * 8]
    assert buffers.kv_indptr.tolist() == [0, 2, 3, 4, 5]
    assert buffers.kv_indices[:5].tolist() == [3, 5, 0, 7, 7]
    assert buffers.kv_last_page_len.tolist() == [2, 3, 1, 1]


def test_a_padded_round_gives_the_real_rows_the_unpadded_logits(tmp_path):
    # Three streams at different lengths; their round alone and padded to 4 and to 8 rows: the same
    # logits for the real rows, and the pool the same outside the spare block.
    model_dir = write_tiny_model(tmp_path / "llama", "llama")
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 60, (n,), generator=gen).tolist() for n in (5, 12, 9)]
    results = []
    for bucket in (None, 4, 8):
        engine = tiny_engine(model_dir, num_slots=16 * BLOCK_SIZE, block_size=BLOCK_SIZE)
        spare = engine.kv.num_blocks - 1
        for lane, prompt in enumerate(prompts):
            open_lane(engine, lane, len(prompt) + 1)
            engine.forward([(lane, 0, tuple(prompt))])
        spans = [SpanView(i, len(p), 1, tuple(engine.lanes[i].blocks)) for i, p in enumerate(prompts)]
        ids, positions = [p[-1] for p in prompts], [len(p) for p in prompts]
        if bucket is not None:
            spans, ids, positions = padded_round(spans, ids, positions, bucket, spare)
        model = engine.model
        with torch.inference_mode():
            logits = model.forward(
                torch.tensor(ids), torch.tensor(positions), spans, engine.kv, list(range(len(ids)))
            )
        outside = [k[:, :, : spare * BLOCK_SIZE].clone() for k in engine.kv.k]
        results.append((logits[: len(prompts)], outside))
    plain_logits, plain_pool = results[0]
    for logits, pool in results[1:]:
        assert torch.equal(logits, plain_logits)
        assert all(torch.equal(a, b) for a, b in zip(pool, plain_pool))


def test_a_graph_step_runs_eagerly_off_the_gpu():
    buffer = torch.zeros(3)
    graph = DecodeGraph(lambda: buffer * 2, "cpu")
    buffer.copy_(torch.tensor([1.0, 2.0, 3.0]))
    assert graph.run().tolist() == [2.0, 4.0, 6.0]


def test_greedy_ids_on_the_device_are_the_host_samplers_tokens():
    gen = torch.Generator().manual_seed(9)
    logits = torch.randn(6, 50, generator=gen)
    logits[1, [3, 17]] = 9.0  # a tie: the lower id
    logits[2, 5] = float("nan")  # NaN reads as -inf
    logits[3] = float("-inf")  # nothing to draw: token 0, as numpy's argmax
    logits[4, :] = float("nan")
    params = [SamplingParams()] * 6
    assert greedy_on_device(params)
    host = sample(logits, params, list(range(6)))
    assert greedy_ids(logits).tolist() == host and host[1] == 3


def test_only_plain_greedy_rounds_go_to_the_device():
    assert not greedy_on_device([SamplingParams(), SamplingParams(temperature=0.7)])
    assert not greedy_on_device([SamplingParams(logprobs=0)])
    assert not greedy_on_device([SamplingParams(repetition_penalty=1.1)])
    assert not greedy_on_device([SamplingParams()], allowed=[torch.zeros(2).numpy()])
    assert not greedy_on_device([SamplingParams()], streams=[object()])


def test_an_engines_greedy_round_returns_the_ids_the_host_would_sample(tmp_path):
    model_dir = write_tiny_model(tmp_path / "llama", "llama")
    engine = tiny_engine(model_dir, num_slots=8 * BLOCK_SIZE, block_size=BLOCK_SIZE)
    for lane, prompt in enumerate(((5, 6, 7), (9, 10))):
        open_lane(engine, lane, len(prompt) + 2)
        engine.forward([(lane, 0, prompt)])
    logits = engine.decode_round([(0, 3, (8,)), (1, 2, (11,))])
    expected = sample(logits, [SamplingParams()] * 2, [4, 3])
    engine.lanes[0].length, engine.lanes[1].length = 3, 2  # the same round again
    ids = engine.decode_round([(0, 3, (8,)), (1, 2, (11,))], greedy=True)
    assert ids.dtype == torch.int64 and ids.tolist() == expected


def test_which_models_replay_decode_graphs():
    fit = dict(windows=False, sinks=False, experts=False, multimodal=False, tp_size=1, group_backend=None)
    assert graphs_unfit("cuda", "paged", **fit) is None
    assert graphs_unfit("cuda", "paged", **(fit | {"tp_size": 2, "group_backend": "nccl"})) is None
    assert "not on cpu" in graphs_unfit("cpu", "paged", **fit)
    assert "FlashInfer" in graphs_unfit("cuda", "spans", **fit)  # SDPA loops over the streams
    assert "sliding-window" in graphs_unfit("cuda", "paged", **(fit | {"windows": True}))
    assert "sliding-window or sink" in graphs_unfit("cuda", "paged", **(fit | {"sinks": True}))
    assert "experts" in graphs_unfit("cuda", "paged", **(fit | {"experts": True}))
    assert "three rows" in graphs_unfit("cuda", "paged", **(fit | {"multimodal": True}))
    assert "(gloo)" in graphs_unfit("cuda", "paged", **(fit | {"tp_size": 2, "group_backend": "gloo"}))


def paged_engine(model_dir, graphs: bool) -> Engine:
    """A tiny model's engine on the paged kernel's SDPA fallback (FlashInfer's place on a GPU), its
    decode rounds through graphs (run eagerly here) or not; 16 lanes' blocks (and graphs' spare)."""
    model = load_rank_model(
        model_dir, tp_rank=0, tp_size=1, dtype=torch.float32, max_positions=256, row_tile=16
    )
    model.attention = paged_kernel(None)
    heads, config = model.kv_heads_per_piece(), model.config
    num_slots = (64 + graphs) * BLOCK_SIZE
    kv = KVPool(config.num_layers, num_slots, heads, config.head_dim, torch.float32, block_size=BLOCK_SIZE)
    return Engine(model, kv, decode_graphs=graphs)


def test_an_engines_graphed_decode_rounds_equal_its_eager_ones(tmp_path):
    # 3 streams (bucket 4), then 5 (bucket 8: a second graph), over rounds: the same logits bit for
    # bit, the same greedy ids, and the pool the same outside the spare block, which no lane gets.
    model_dir = write_tiny_model(tmp_path / "llama", "llama")
    gen = torch.Generator().manual_seed(6)
    prompts = [torch.randint(3, 60, (n,), generator=gen).tolist() for n in (5, 12, 9, 3, 17)]
    runs = []
    for graphs in (False, True):
        engine = paged_engine(model_dir, graphs)
        assert engine.num_blocks == 64 and (engine.graphs is not None) == graphs
        tokens, outputs = [], []
        for lane, prompt in enumerate(prompts):
            open_lane(engine, lane, len(prompt) + 8)
            logits = engine.forward([(lane, 0, tuple(prompt))])
            tokens.append(int(logits[0].argmax()))
        for step in range(4):
            lanes = range(3) if step < 2 else range(5)
            steps = [(lane, engine.lanes[lane].length, (tokens[lane],)) for lane in lanes]
            if step == 3:
                ids = engine.decode_round(steps, greedy=True)
                outputs.append(ids)
                continue
            logits = engine.decode_round(steps)
            outputs.append(logits)
            for lane, row in zip(lanes, logits):
                tokens[lane] = int(row.argmax())
        used = engine.num_blocks * BLOCK_SIZE
        runs.append((outputs, [k[:, :, :used].clone() for k in engine.kv.k]))
        if graphs:
            assert sorted(engine.graphs._graphs) == [4, 8]
            with pytest.raises(EngineError, match="outside the pool"):
                engine.admit(9, (engine.num_blocks,))  # the spare block
    (eager, eager_pool), (graphed, graphed_pool) = runs
    assert all(torch.equal(a, b) for a, b in zip(eager, graphed))
    assert all(torch.equal(a, b) for a, b in zip(eager_pool, graphed_pool))
