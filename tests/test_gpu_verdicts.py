"""What the GPU check's device rows build, checked on the CPU (bench/gpu_verdicts.py): the int4 and
fp8 weights its product row times (through torch's CPU twins of both products) are the bf16
weight's within the row's own bars; a device-only row says "no CUDA" here; a check's verdict is
read the same way for every row, and one that raised fails."""

from __future__ import annotations

import torch
from engine_lanes import tiny_engine
from tiny_models import write_tiny_model

from bench.gpu_verdicts import (
    NO_CUDA,
    QUANT_MAX_REL_DIFF,
    decode_graphs,
    fp8_of,
    int4_of,
    paged_kernel,
    paged_rows,
    quantized_products,
    quantized_rows,
    roof_verdicts,
    timed_run,
    verdicts,
)

CPU = torch.device("cpu")


def test_the_quantized_weights_the_row_times_are_the_bf16_weights_within_its_bars():
    gen = torch.Generator().manual_seed(0)
    weight = (torch.randn(256, 512, generator=gen) / 512**0.5).to(torch.bfloat16)
    x = torch.randn(4, 512, generator=gen).to(torch.bfloat16)
    reference = (x.float() @ weight.float().T).abs().max()
    for name, build in (("int4", int4_of), ("fp8", fp8_of)):
        diff = (build(weight)(x).float() - x.float() @ weight.float().T).abs().max() / reference
        assert 0 < diff <= QUANT_MAX_REL_DIFF[name], (name, float(diff))


def test_device_rows_say_no_cuda_off_a_gpu(tmp_path):
    assert paged_kernel(CPU) == {"verdict": NO_CUDA}
    assert quantized_products(CPU) == {"verdict": NO_CUDA}
    assert timed_run(5.0, CPU)["verdict"] == NO_CUDA
    decode = roof_verdicts({"rows": [{"of_roof": 0.9}]}, CPU)
    assert decode["verdict"] == NO_CUDA and decode["rows"][0]["verdict"] == NO_CUDA
    engine = tiny_engine(write_tiny_model(tmp_path / "llama", "llama"), num_slots=64)
    assert decode_graphs(engine, lanes=None) == {"verdict": NO_CUDA}


def test_roof_and_time_verdicts_on_a_gpu():
    gpu = torch.device("cuda", 0)  # a device object only: nothing runs on it
    decode = roof_verdicts({"rows": [{"of_roof": 0.5}, {"of_roof": 0.1}]}, gpu)
    assert [r["verdict"] for r in decode["rows"]] == ["pass", "fail"] and decode["verdict"] == "fail"
    assert timed_run(599.0, gpu)["verdict"] == "pass" and timed_run(601.0, gpu)["verdict"] == "fail"


def test_each_checks_verdict_is_read_alike():
    checks = {
        "a": {"verdict": "pass"},
        "b": {"error": "RuntimeError: boom"},
        "c": {"skipped": "one GPU here"},
        "d": {"holds": True},  # a finding with no verdict of its own
    }
    assert verdicts(checks) == {"a": "pass", "b": "fail", "c": "skipped: one GPU here"}


def test_the_rows_a_gpu_runs_build_and_run_here():
    # The same passes and products, on the CPU: the paged row's SDPA fallback against itself, and
    # torch's CPU twins of the int4 and fp8 products on a smaller weight.
    rows = paged_rows(CPU, backend=None)
    assert (
        rows["verdict"] == "pass" and rows["prefill"]["max_abs_diff"] == rows["decode"]["max_abs_diff"] == 0
    )
    products = quantized_rows(CPU, (256, 512))
    for name in ("int4", "fp8"):
        assert set(products[name]) == {"rows_1", "rows_32", "verdict"}, products[name]
        assert all(
            0 < r["max_rel_diff"] <= QUANT_MAX_REL_DIFF[name]
            for k, r in products[name].items()
            if k != "verdict"
        )
