"""launch.sh starts the ranks the way each deployment needs, run for real with a stub .venv python
that records its command line (torchrun's, or the one rank's across two hosts) and the interface
named to gloo and NCCL, and exits as a rank would."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
STUB_PYTHON = """#!/usr/bin/env bash
echo "$*" >> "$STUB_LOG"
echo "${GLOO_SOCKET_IFNAME:-}:${NCCL_SOCKET_IFNAME:-}" > "$STUB_LOG.interface"
exit "${STUB_EXIT:-0}"
"""


def run_launch(tmp_path: Path, *args: str, exit_code: int = 0):
    """(launch.sh's exit code, its stderr, the one command line it ran, or None)."""
    repo = tmp_path / "repo"
    (repo / ".venv" / "bin").mkdir(parents=True)
    shutil.copy(REPO_ROOT / "launch.sh", repo / "launch.sh")
    python = repo / ".venv" / "bin" / "python"
    python.write_text(STUB_PYTHON)
    python.chmod(0o755)
    log = tmp_path / "calls.log"
    log.write_text("")
    done = subprocess.run(
        ["bash", str(repo / "launch.sh"), *args],
        env={"PATH": "/usr/bin:/bin", "STUB_LOG": str(log), "STUB_EXIT": str(exit_code)},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    calls = log.read_text().splitlines()
    assert len(calls) <= 1, calls
    return done.returncode, done.stderr, calls[0] if calls else None, repo


def test_one_host_runs_both_ranks_under_torchrun_with_the_default_config(tmp_path):
    code, err, call, repo = run_launch(tmp_path, "--port", "50060")
    assert code == 0, err
    assert call == (
        f"-m torch.distributed.run --standalone --nproc-per-node 2 -m tpserve.cli serve "
        f"--config {repo}/configs/default.yaml --port 50060"
    )


def test_each_host_of_a_pair_runs_its_one_rank_itself_that_meets_rank_0(tmp_path):
    # No torchrun across hosts: the rank is launch.sh's own process, so a stop signal reaches it.
    code, err, call, _ = run_launch(
        tmp_path, "--config", "configs/gb10-pair.yaml", "--rank", "1", "--master", "hostA:29600"
    )
    assert code == 0, err
    assert call == "-m tpserve.cli serve --rank 1 --master hostA:29600 --config configs/gb10-pair.yaml"
    assert (tmp_path / "calls.log.interface").read_text().strip() == ":"  # none named: gloo picks


def test_the_interface_is_passed_to_the_rank_and_named_to_gloo_and_nccl(tmp_path):
    code, err, call, _ = run_launch(
        tmp_path, "--rank", "0", "--master", "10.0.0.1", "--interface", "enp1s0f0np0", "--lanes", "4"
    )
    assert code == 0, err
    assert call.startswith("-m tpserve.cli serve --rank 0 --master 10.0.0.1 --config ")
    assert "--interface enp1s0f0np0 --lanes 4" in call
    assert (tmp_path / "calls.log.interface").read_text().strip() == "enp1s0f0np0:enp1s0f0np0"


def test_a_rank_that_refuses_to_start_fails_the_launch_with_its_code(tmp_path):
    # A rank refusing its device (say, two ranks on a one-GPU host) exits 2; so does launch.sh.
    code, _, call, _ = run_launch(tmp_path, "--tp", "2", exit_code=2)
    assert code == 2 and "--nproc-per-node 2" in call


def test_master_without_rank_is_refused_before_anything_starts(tmp_path):
    code, err, call, _ = run_launch(tmp_path, "--master", "hostA")
    assert code == 2 and "--master needs --rank" in err
    assert call is None


def test_rank_without_master_is_refused_before_anything_starts(tmp_path):
    code, err, call, _ = run_launch(tmp_path, "--rank", "1")
    assert code == 2 and "--rank needs --master" in err
    assert call is None
