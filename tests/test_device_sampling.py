"""Greedy rounds sampled where the logits are (kernels/device_sampling.py): the leader takes a round's
tokens on the device on a GPU, for a round of plain greedy rows whose logits nothing else reads,
and copies back only the ids; here, on two CPU ranks told they are on a GPU, those ids equal the
host sampler's tokens round after round."""

from __future__ import annotations

import numpy as np
from tiny_models import write_tiny_model

from tpserve.generate import single_stream_leader
from tpserve.kernels.device_sampling import samples_on_device
from tpserve.kernels.sampling_params import SamplingParams
from tpserve.ranks.settings import EngineSettings
from tpserve.server.backend import DecodeItem, PrefillItem

GREEDY = SamplingParams()
PROMPTS = ((5, 6, 7, 8, 9), (21, 22, 23))
NUM_ROUNDS = 6


def test_the_chooser_takes_plain_greedy_rounds_on_a_gpu_only():
    assert samples_on_device("cuda", [GREEDY, GREEDY])
    assert not samples_on_device("cpu", [GREEDY, GREEDY])  # the host sampler reads them there already
    assert not samples_on_device("cuda", [GREEDY, SamplingParams(temperature=0.8)])
    assert not samples_on_device("cuda", [SamplingParams(logprobs=2)])
    assert not samples_on_device("cuda", [SamplingParams(repetition_penalty=1.2)])
    assert not samples_on_device("cuda", [GREEDY], allowed=[np.ones(4, dtype=bool)])
    assert not samples_on_device("cuda", [GREEDY], streams=[object()])
    assert not samples_on_device("cuda", [GREEDY], records_logits=True)


def decoded(leader, device_type: str) -> list[list[int]]:
    """Both prompts prefilled, then NUM_ROUNDS greedy rounds of both lanes with the leader sampling
    as on `device_type`; the lanes closed after."""
    leader.device_type = device_type
    tokens, blocks = [], 0
    for lane, prompt in enumerate(PROMPTS):
        count = -(-(len(prompt) + NUM_ROUNDS + 1) // leader.block_size)
        leader.open(lane, tuple(range(blocks, blocks + count)), 0)
        blocks += count
        tokens.append([leader.prefill(PrefillItem(lane, 0, prompt, True, GREEDY))])
    for step in range(NUM_ROUNDS):
        items = [DecodeItem(lane, len(p) + step, tokens[lane][-1], GREEDY) for lane, p in enumerate(PROMPTS)]
        assert leader._greedy_on_device(items) == (device_type == "cuda")
        for lane, token in enumerate(leader.decode(items)):
            assert isinstance(token, int)
            tokens[lane].append(token)
    for lane in range(len(PROMPTS)):
        leader.close(lane)
    return tokens


def test_device_greedy_ids_equal_the_host_samplers_tokens_on_two_ranks(tmp_path):
    settings = EngineSettings(
        model_dir=str(write_tiny_model(tmp_path / "llama", "llama")), device="cpu", dtype="float32",
        tp_size=2, num_lanes=2, context_size=64, batch_invariant=False, draft_tokens=0,
        kv_block_size=8, threads_per_rank=1,
    )  # fmt: skip
    with single_stream_leader(settings) as leader:
        host = decoded(leader, "cpu")
        device = decoded(leader, "cuda")  # the followers' messages are the same: they keep pace
        again = decoded(leader, "cpu")
    assert device == host == again
    assert len({tuple(t) for t in host}) == 2
