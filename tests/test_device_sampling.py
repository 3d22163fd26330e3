"""Greedy rounds sampled where the logits are (tpserve/kernels/device_sampling.py): the leader takes a round's
tokens on the device on a GPU, for a round of plain greedy rows whose logits nothing else reads,
and copies back only the ids; here, on two CPU ranks told they are on a GPU, those ids equal the
host sampler's tokens round after round."""

from __future__ import annotations

import numpy as np
from device_rounds import host_device_host

from tpserve.kernels.device_sampling import samples_on_device
from tpserve.kernels.sampling_params import SamplingParams

GREEDY = SamplingParams()
PROMPTS = ((5, 6, 7, 8, 9), (21, 22, 23))


def test_the_chooser_takes_plain_greedy_rounds_on_a_gpu_only():
    assert samples_on_device("cuda", [GREEDY, GREEDY])
    assert not samples_on_device("cpu", [GREEDY, GREEDY])  # the host sampler reads them there already
    assert not samples_on_device("cuda", [GREEDY, SamplingParams(temperature=0.8)])
    assert not samples_on_device("cuda", [SamplingParams(logprobs=2)])
    assert not samples_on_device("cuda", [SamplingParams(repetition_penalty=1.2)])
    assert not samples_on_device("cuda", [GREEDY], allowed=[np.ones(4, dtype=bool)])
    assert not samples_on_device("cuda", [GREEDY], streams=[object()])
    assert not samples_on_device("cuda", [GREEDY], records_logits=True)


def test_device_greedy_ids_equal_the_host_samplers_tokens_on_two_ranks(tmp_path):
    lanes = [(prompt, GREEDY) for prompt in PROMPTS]
    host, device, again = host_device_host(
        tmp_path, lanes, lambda leader, items: leader._greedy_on_device(items)
    )
    assert device == host == again
    assert len({tuple(t) for t in host}) == 2
