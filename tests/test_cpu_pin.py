"""`make test` on a GPU host runs the suite on the CPU: every engine a test starts (in process, as a
daemon, through `tpserve generate` or a benchmark) is told `device: cpu`, since `device: auto` would
take the GPU there (bfloat16, no batch invariance, and tp=2 refused on one GPU). Tests that need
the GPU are marked `gpu` and skipped where torch sees none. Checked here from what the fixtures
build and, for every EngineSettings a test file constructs, from the source."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest
import test_cache_pair_default
import test_engine_pair
import test_engine_pair_default
import test_startup
import torch
from daemon import Daemon, serve_args

from bench.common import bench_settings
from tpserve.server.config import load_config

TESTS = Path(__file__).resolve().parent
# EngineSettings built only to read a decision off them (no rank starts from them).
VALUE_ONLY = {
    "test_config.py": "the serving config's defaults, compared field by field",
    "test_gpu_wiring.py": "what for_device decides for an auto setting",
}


def test_the_settings_the_fixtures_build_say_cpu():
    built = [
        test_engine_pair.pair_settings("m"),
        test_startup.settings_for("m"),
        test_cache_pair_default.settings_for("m", 0),
        test_engine_pair_default.settings_for("m", "float32"),
        bench_settings("m"),
    ]
    assert [settings.device for settings in built] == ["cpu"] * len(built)


def test_every_test_daemon_is_served_on_the_cpu(tmp_path):
    args = serve_args("model", Daemon("spawn", 1, 2, 3, tmp_path))
    # The flags as `tpserve serve` reads them, over the config's own `device: auto`.
    flags = dict(zip(args[::2], args[1::2]))
    assert flags["--device"] == "cpu"
    config = load_config(
        None, {name.removeprefix("--").replace("-", "_"): value for name, value in flags.items()}
    )
    assert config.device == "cpu" and load_config(None, {}).device == "auto"


def engine_settings_calls(path: Path):
    """(line, keyword names, whether `.for_device(...)` is called on it at once) of every
    EngineSettings(...) call in the file."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    decided = {
        id(node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and node.attr == "for_device"
    }
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "EngineSettings":
            yield node.lineno, {k.arg for k in node.keywords}, id(node) in decided


def test_every_engine_settings_a_test_builds_names_its_device():
    unpinned = [
        f"{path.name}:{line}"
        for path in sorted(TESTS.glob("*.py"))
        if path.name not in VALUE_ONLY
        for line, keywords, decided in engine_settings_calls(path)
        if "device" not in keywords and not decided
    ]
    assert unpinned == [], "EngineSettings without device= (auto takes the GPU on a GPU host)"


@pytest.mark.gpu
def test_a_test_marked_gpu_runs_only_where_torch_sees_one():
    assert torch.cuda.is_available()


def test_the_gpu_marker_skips_where_there_is_no_gpu():
    node = "tests/test_cpu_pin.py::test_a_test_marked_gpu_runs_only_where_torch_sees_one"
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", node],
        cwd=TESTS.parent,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    if torch.cuda.is_available():
        assert "1 passed" in done.stdout, done.stdout
    else:
        assert done.returncode == 0 and "1 skipped" in done.stdout, done.stdout
        assert "marked gpu: torch sees no CUDA GPU here" in done.stdout
