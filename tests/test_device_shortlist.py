"""Sampled rows shortlisted where the logits are (tpserve/kernels/device_sampling.py shortlist): over many
random rows, seeds, positions and params, the host's draw over the shortlist is `sample`'s draw
over the whole row, token for token, and the list holds every token the host sampler reads."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from device_rounds import host_device_host

from tpserve.kernels.device_sampling import Shortlist, lists_on_device, shortlist
from tpserve.kernels.sampling import _candidates, _gumbel, _row_key, _scaled, sample, sample_listed
from tpserve.kernels.sampling_params import SamplingParams
from tpserve.ranks.device_wait import DeviceTimeout, wait_for

TEMPERATURES = (0.01, 0.1, 0.3, 0.7, 1.0, 1.5, 3.0, 10.0)
TOP_KS = (0, 1, 2, 5, 40, 300)


def test_the_chooser_lists_plain_sampled_rounds_on_a_gpu_only():
    sampled, greedy = SamplingParams(temperature=0.8), SamplingParams()
    assert lists_on_device("cuda", [sampled, greedy])
    assert lists_on_device("cuda", [SamplingParams(temperature=1.0, top_k=40, top_p=0.9, min_p=0.05)])
    assert not lists_on_device("cuda", [greedy, greedy])  # all greedy: samples_on_device takes it
    assert not lists_on_device("cpu", [sampled])
    assert not lists_on_device("cuda", [SamplingParams(temperature=1.0, top_p=0.9)])  # whole-row mass
    assert not lists_on_device("cuda", [SamplingParams(temperature=1.0, logprobs=0)])
    assert not lists_on_device("cuda", [SamplingParams(temperature=1.0, presence_penalty=0.5)])
    assert not lists_on_device("cuda", [sampled], allowed=[np.ones(4, dtype=np.int32)])
    assert not lists_on_device("cuda", [sampled], streams=[object()])
    assert not lists_on_device("cuda", [sampled], records_logits=True)


def random_params(rng: np.random.Generator, vocab_size: int) -> SamplingParams:
    """Sampled params lists_on_device takes: any temperature, top_k, min_p; top_p only with top_k."""
    top_k = int(rng.choice([*TOP_KS, vocab_size - 1, vocab_size + 7]))
    top_p = float(rng.choice([1.0, 0.3, 0.9, 0.999])) if top_k > 0 else 1.0
    return SamplingParams(
        temperature=float(rng.choice(TEMPERATURES)), top_k=top_k, top_p=top_p,
        min_p=float(rng.choice([0.0, 0.0, 0.02, 0.3])), seed=int(rng.integers(0, 2**63)),
    )  # fmt: skip


def random_rows(rng: np.random.Generator, num_rows: int, vocab_size: int) -> torch.Tensor:
    """[num_rows, vocab] float32 rows of many shapes: model-like spreads, coarse grids full of ties
    (near-ties at the max too), flat rows whose bound admits nearly every token, and -inf and NaN."""
    rows = []
    for _ in range(num_rows):
        kind = rng.integers(0, 6)
        row = rng.standard_normal(vocab_size) * float(rng.choice([0.3, 2.0, 5.0, 12.0]))
        if kind == 1:
            row = np.round(row * 2) / 2  # ties everywhere, the max's included
        elif kind == 2:
            row = rng.standard_normal(vocab_size) * 0.05  # flat: the bound lists every token
        elif kind == 3:
            row[rng.random(vocab_size) < 0.5] = -np.inf  # a grammar-like mask already applied
        elif kind == 4:
            row[rng.integers(0, vocab_size, size=3)] = np.nan
            row[rng.integers(0, vocab_size)] = row.max() - 1e-6  # a near-tie with the max
        rows.append(row + float(rng.choice([0.0, 30.0, -1000.0])))
    return torch.tensor(np.array(rows), dtype=torch.float32)


def listed_draw(logits: torch.Tensor, params, positions) -> tuple[list[int], Shortlist]:
    listed = Shortlist.unpack(shortlist(logits, params))
    tokens = sample_listed(
        listed.greedy_ids, listed.rows, listed.ids, listed.logits, params, positions, listed.vocab_size
    )
    return tokens, listed


def test_the_draw_over_the_shortlist_is_the_draw_over_the_whole_row():
    rng = np.random.default_rng(27)
    forms = set()  # listed tokens, or (when listing cost more) the whole rows
    for vocab_size in (50, 257, 4099):
        for _ in range(12):
            logits = random_rows(rng, 24, vocab_size)
            params = [
                random_params(rng, vocab_size) if rng.random() < 0.85 else SamplingParams() for _ in range(24)
            ]
            positions = rng.integers(0, 2**40, size=24).tolist()
            tokens, listed = listed_draw(logits, params, positions)
            assert tokens == sample(logits, params, positions)
            forms.add(len(listed.ids) == logits.numel())
    assert forms == {True, False}


def test_a_peaked_row_lists_a_small_share_of_its_vocabulary():
    # Model-like rows: a bulk of logits with a spread of 2.5 and a best token well above it.
    rng = np.random.default_rng(8)
    logits = torch.tensor(rng.standard_normal((8, 32000)) * 2.5, dtype=torch.float32)
    logits[torch.arange(8), rng.integers(0, 32000, size=8)] = 25.0
    temperatures = (0.3, 0.6, 0.8, 1.0) * 2  # at 1.0 the bound reaches 19.5 below the best: 1.4% of the bulk
    params = [SamplingParams(temperature=t, top_k=k, seed=3) for t, k in zip(temperatures, (*TOP_KS, 0, 40))]
    positions = list(range(8))
    tokens, listed = listed_draw(logits, params, positions)
    assert tokens == sample(logits, params, positions)
    assert len(listed.ids) < 0.01 * logits.numel()


def test_half_precision_logits_list_as_their_float32_values():
    rng = np.random.default_rng(5)
    for dtype in (torch.bfloat16, torch.float16):
        logits = (random_rows(rng, 32, 1000).clamp(-6e4, 6e4)).to(dtype)
        params = [random_params(rng, 1000) for _ in range(32)]
        positions = list(range(32))
        assert listed_draw(logits, params, positions)[0] == sample(logits, params, positions)


def test_the_list_holds_every_candidate_the_host_sampler_reads():
    # Stronger than equal tokens: the host's candidates (within its Gumbel bound, before the
    # filters) of the whole row are all listed, whatever the row's greedy noise.
    rng = np.random.default_rng(11)
    for _ in range(40):
        logits = random_rows(rng, 16, 2048)
        params = [
            SamplingParams(temperature=float(t), seed=s) for s, t in enumerate(rng.choice(TEMPERATURES, 16))
        ]
        listed = Shortlist.unpack(shortlist(logits, params))
        scores = torch.where(logits.isnan(), float("-inf"), logits).numpy()
        for row, p in enumerate(params):
            greedy = int(scores[row].argmax())
            noise = float(_gumbel(np.uint64(_row_key(p.seed, row)), np.array([greedy]))[0])
            scaled = _scaled(scores[row], p)
            wanted, _ = _candidates(scaled, None, len(scaled), p, greedy, noise)
            assert set(wanted.tolist()) <= set(listed.ids[listed.rows == row].tolist())


def test_tokens_at_the_edge_of_the_bound_are_listed():
    # A row's tokens spread finely across the Gumbel span below the max, at every temperature: the
    # draws of many seeds agree, where a token just inside the host's bound can win.
    rng = np.random.default_rng(3)
    for temperature in TEMPERATURES:
        row = 7.0 - np.linspace(0.0, 19.6, 4096) * temperature  # scaled: 0 down to 19.6 below the max
        rng.shuffle(row)
        logits = torch.tensor(row, dtype=torch.float32).expand(64, -1)
        params = [SamplingParams(temperature=temperature, seed=seed) for seed in range(64)]
        positions = rng.integers(0, 2**31, size=64).tolist()
        assert listed_draw(logits, params, positions)[0] == sample(logits, params, positions)


def test_a_row_with_top_p_and_top_k_lists_its_top_k_best():
    # Top_k larger than the bound's candidates: top_p's mass is over the top_k best, all listed.
    logits = torch.tensor(np.concatenate(([40.0], np.linspace(0.0, 1.0, 999)))[None], dtype=torch.float32)
    params = [SamplingParams(temperature=1.0, top_k=500, top_p=0.999999, seed=1)]
    tokens, listed = listed_draw(logits, params, [9])
    assert len(listed.ids) >= 500
    assert tokens == sample(logits, params, [9])


def test_rows_with_nothing_to_draw_from_keep_their_greedy_token_and_list_nothing():
    logits = torch.tensor([[float("-inf")] * 6, [float("nan")] * 6, [0.0, 1e38, 3e38, 0.0, 1.0, 2.0]])
    params = [
        SamplingParams(temperature=0.5, seed=1),
        SamplingParams(temperature=2.0),
        SamplingParams(temperature=1e-3),
    ]
    tokens, listed = listed_draw(logits, params, [1, 2, 3])
    assert tokens == sample(logits, params, [1, 2, 3])
    assert 0 not in listed.rows.tolist() and 1 not in listed.rows.tolist()


LANES = (  # (prompt, sampling): a sampled lane, a filtered one, a greedy one beside them
    ((5, 6, 7, 8, 9), SamplingParams(temperature=1.5, seed=7)),
    ((21, 22, 23), SamplingParams(temperature=0.9, top_k=5, top_p=0.8, min_p=0.05, seed=2)),
    ((30, 31), SamplingParams()),
)


def test_device_shortlisted_draws_equal_the_host_samplers_on_two_ranks(tmp_path):
    host, device, again = host_device_host(
        tmp_path, LANES, lambda leader, items: leader._lists_on_device(items)
    )
    assert device == host == again
    assert len({tuple(t) for t in host}) == 3


def test_a_device_that_never_gives_the_lists_size_is_a_timeout_not_a_hang():
    # The list's size is the one value the host must have before the list: it comes through the
    # caller's copy with a deadline (tpserve/ranks/device_wait.py), here a device whose copy never finishes.
    class Never:
        def query(self) -> bool:
            return False

    clock = iter(range(100)).__next__
    wait = lambda size: wait_for(Never(), 5.0, "a shortlist's size", clock=clock, sleep=lambda _: None)  # noqa: E731
    logits = torch.randn(2, 50)
    with pytest.raises(DeviceTimeout, match="a shortlist's size"):
        shortlist(logits, [SamplingParams(temperature=1.0, seed=1)] * 2, wait)


def test_the_lists_size_is_the_only_value_taken_to_the_host():
    taken = []
    logits = torch.randn(3, 500) * 2.5
    logits[:, 7] = 25.0  # a peaked row lists a few tokens, not the whole row
    params = [
        SamplingParams(temperature=0.7, seed=2),
        SamplingParams(),
        SamplingParams(temperature=1.0, top_k=5),
    ]
    packed = shortlist(logits, params, lambda size: taken.append(size) or size)
    assert [t.numel() for t in taken] == [1]
    assert Shortlist.unpack(packed).ids.size == int(taken[0])
