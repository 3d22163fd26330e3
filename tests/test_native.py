"""The C kernels (tpserve/kernels/native.py): built once per machine, the same bits as the torch ops they
replace where they claim to, and a missing or broken compiler named rather than crashing."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from tiny_models import write_tiny_model

from tpserve.kernels import int8_linear, native, norms

pytestmark = pytest.mark.skipif(
    not (shutil.which("cc") or shutil.which("gcc")), reason="no C compiler on this machine"
)


def test_a_kernel_is_built_once_and_then_loaded_from_its_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(native, "cache_dir", lambda: tmp_path)
    native.load.cache_clear()
    try:
        native.load("rms_norm")
        built = list(tmp_path.glob("rms_norm-*.so"))
        assert len(built) == 1 and not list(tmp_path.glob("*.partial"))
        stamp = built[0].stat().st_mtime_ns
        native.load.cache_clear()
        native.load("rms_norm")
        assert built[0].stat().st_mtime_ns == stamp  # loaded, not rebuilt
    finally:
        native.load.cache_clear()


def test_a_kernel_is_rebuilt_when_a_header_it_may_include_changes(tmp_path, monkeypatch):
    # q4_linear.c and q8_linear.c share block_quantize.h: a stale build of either would quantize its
    # inputs differently from the other.
    sources = tmp_path / "native"
    sources.mkdir()
    (sources / "tiny.c").write_text('#include "tiny.h"\nint tp_tiny(void) { return TINY; }\n')
    monkeypatch.setattr(native, "SOURCE_DIR", sources)
    monkeypatch.setattr(native, "cache_dir", lambda: tmp_path / "cache")
    try:
        for value in (1, 2):
            (sources / "tiny.h").write_text(f"#define TINY {value}\n")
            native.load.cache_clear()
            assert native.load("tiny").tp_tiny() == value
        assert len(list((tmp_path / "cache").glob("tiny-*.so"))) == 2
    finally:
        native.load.cache_clear()


def test_a_broken_compiler_is_named_not_raised_as_a_crash(tmp_path, monkeypatch):
    fake = tmp_path / "cc"
    fake.write_text(
        '#!/bin/sh\nif [ "$1" = --version ]; then echo fake 1.0; exit 0; fi\necho nope >&2; exit 1\n'
    )
    fake.chmod(0o755)
    monkeypatch.setenv("CC", str(fake))
    monkeypatch.setattr(native, "cache_dir", lambda: tmp_path / "cache")
    native.load.cache_clear()
    try:
        with pytest.raises(native.NativeUnavailable, match="failed on rms_norm.c: nope"):
            native.load("rms_norm")
    finally:
        native.load.cache_clear()


def test_rms_norm_matches_torch_and_a_row_is_the_same_in_any_batch():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(37, 576, generator=gen) * 4
    weight = torch.rand(576, generator=gen) + 0.5
    ours = norms.rms_norm(x, weight, 1e-5)
    torch.testing.assert_close(ours, F.rms_norm(x, (576,), weight, 1e-5), rtol=1e-6, atol=1e-6)
    for rows in (slice(0, 1), slice(5, 6), slice(3, 20), slice(36, 37)):
        assert torch.equal(norms.rms_norm(x[rows], weight, 1e-5), ours[rows])
    heads = torch.randn(5, 3, 64, generator=gen)[:, 1:]  # q/k norms: strided [T, H, D] heads
    torch.testing.assert_close(
        norms.rms_norm(heads, weight[:64], 1e-6), F.rms_norm(heads, (64,), weight[:64], 1e-6)
    )


def test_int8_rows_have_the_bits_of_the_torch_ops_they_replace(monkeypatch):
    gen = torch.Generator().manual_seed(1)
    weight = int8_linear.Int8Weight(torch.randn(200, 320, generator=gen) * 0.05)
    x = torch.randn(19, 320, generator=gen) * torch.rand(19, 1, generator=gen) * 30
    x[3] = 0  # a zero row: its absmax is clamped, not divided by
    natively = weight(x)
    strided = weight(torch.cat([x, x], dim=1)[:, :320])  # rows of a wider tensor
    monkeypatch.setattr(int8_linear, "_native_rows", lambda: None)
    by_torch = weight(x)
    assert torch.equal(natively, by_torch)
    assert torch.equal(strided, by_torch)


def test_without_a_compiler_the_engine_serves_on_torch_kernels(tmp_path):
    # A fresh process whose compiler fails and whose cache is empty: attention falls back to the
    # tiled products, the norms to torch's, auto picks int8, and a pass still runs.
    model_dir = write_tiny_model(tmp_path / "model", "llama")
    script = f"""
import torch
from tpserve.kernels.weight_formats import auto_quantize, quantize_unavailable
from tpserve.ranks.engine import Engine
from tpserve.ranks.kv_store import KVPool
from tpserve.ranks.loader import load_rank_model
model = load_rank_model({str(model_dir)!r}, tp_rank=0, tp_size=1, dtype=torch.float32, max_positions=64,
                        row_tile=16, quantize=auto_quantize("cpu"))
kv = KVPool(model.config.num_layers, 64, model.kv_heads_per_piece(), model.config.head_dim, torch.float32)
engine = Engine(model, kv)
engine.admit(0, tuple(range(32)))
logits = engine.forward([(0, 0, (3, 4, 5))])
print(model.attention.name, auto_quantize("cpu"), bool(quantize_unavailable("int4", "cpu")), bool(torch.isfinite(logits).all()))
"""
    env = {**os.environ, "CC": "/bin/false", "HOME": str(tmp_path / "home")}
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["tiled", "int8", "True", "True"]
