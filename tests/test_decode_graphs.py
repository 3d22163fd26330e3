"""Decode rounds padded to graph buckets (ranks/decode_graphs.py), run here eagerly as a GPU replays
them: the bucket a round takes, the padding rows confined to the spare block, the real rows' logits
the unpadded round's bit for bit; and greedy rows' ids taken where the logits are
(kernels/device_sampling.py) equal to the host sampler's tokens."""

from __future__ import annotations

import pytest
import torch
from engine_lanes import open_lane, tiny_engine
from tiny_models import write_tiny_model

from tpserve.kernels.attention import SpanView
from tpserve.kernels.device_sampling import greedy_ids, greedy_on_device
from tpserve.kernels.sampling import sample
from tpserve.kernels.sampling_params import SamplingParams
from tpserve.ranks.decode_graphs import DECODE_BUCKETS, DecodeBuffers, DecodeGraph, bucket_for, padded_round

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
