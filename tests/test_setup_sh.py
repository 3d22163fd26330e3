"""scripts/setup.sh on the machines it meets, run for real against stubs on PATH: `nvidia-smi` (a
GPU or none, and its driver), `uname` (x86-64 or a GB10's aarch64) and a .venv python whose pip
records what it was asked to install and whose torch is a CPU build, a CUDA build or none."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
CPU_TORCH = "torch==2.13.0"
GB10_INDEX = "--index-url https://download.pytorch.org/whl/cu130"
X86_INDEX = "--index-url https://download.pytorch.org/whl/cu128"
DRIVER = "580.95.05"

# A .venv python: `-c` snippets answer from the torch recorded in $STUB_TORCH (none, cpu or cuda;
# a CUDA build sees the GPU only when $STUB_DRIVER_OK is 1); pip records its calls and installs
# a CUDA build from a CUDA wheel index, a CPU build otherwise (as this machine's registry does).
STUB_PYTHON = r"""#!/usr/bin/env bash
echo "python $*" >> "$STUB_LOG"
torch=$(cat "$STUB_TORCH")
if [ "$1" = -c ]; then
    case "$2" in
        *cuda.is_available*) [ "$torch" = cuda ] && [ "$STUB_DRIVER_OK" = 1 ]; exit $? ;;
        *torch.__version__*) [ "$torch" != none ] || exit 1; echo "torch 2.13.0+$torch (CUDA 13.0)"; exit 0 ;;
        *"import torch"*) [ "$torch" != none ]; exit $? ;;
    esac
    exit 0
fi
if [ "$1 $2" = "-m pip" ]; then
    case " $* " in
        *" uninstall "*) echo none > "$STUB_TORCH" ;;
        *" --index-url "*torch==*) echo cuda > "$STUB_TORCH" ;;
        *" torch=="*) echo cpu > "$STUB_TORCH" ;;
    esac
fi
exit 0
"""
NVIDIA_SMI_WITH_GPU = f"""#!/usr/bin/env bash
case "$*" in
    -L) echo "GPU 0: NVIDIA GB10 (UUID: GPU-0)" ;;
    *driver_version*) echo "{DRIVER}" ;;
esac
"""
NVIDIA_SMI_WITHOUT_GPU = """#!/usr/bin/env bash
echo "No devices were found"; exit 6
"""


def _executable(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(0o755)


def run_setup(tmp_path: Path, *, gpu: bool, machine: str, torch: str, driver_ok: bool = True, env=None):
    """Run a copy of setup.sh in a bare checkout; returns (exit code, stderr, python calls, torch after)."""
    repo, stubs = tmp_path / "repo", tmp_path / "bin"
    (repo / "scripts").mkdir(parents=True)
    shutil.copy(REPO_ROOT / "scripts" / "setup.sh", repo / "scripts" / "setup.sh")
    _executable(repo / ".venv" / "bin" / "python", STUB_PYTHON)
    _executable(repo / ".venv" / "bin" / "tpserve", '#!/usr/bin/env bash\necho "tpserve $*" >> "$STUB_LOG"\n')
    _executable(stubs / "nvidia-smi", NVIDIA_SMI_WITH_GPU if gpu else NVIDIA_SMI_WITHOUT_GPU)
    _executable(stubs / "uname", f'#!/usr/bin/env bash\necho "{machine}"\n')
    log, state = tmp_path / "calls.log", tmp_path / "torch"
    log.write_text("")
    state.write_text(torch + "\n")
    environment = {
        "PATH": f"{stubs}:/usr/bin:/bin",
        "HOME": str(tmp_path),
        "STUB_LOG": str(log),
        "STUB_TORCH": str(state),
        "STUB_DRIVER_OK": "1" if driver_ok else "0",
        **(env or {}),
    }
    done = subprocess.run(
        ["bash", str(repo / "scripts" / "setup.sh")],
        env=environment,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    return done.returncode, done.stderr, log.read_text().splitlines(), state.read_text().strip()


def torch_installs(calls: list[str]) -> list[str]:
    return [call for call in calls if " pip install " in f" {call} " and "torch" in call.split()[-1]]


@pytest.mark.parametrize("machine", ["x86_64", "aarch64"])
def test_a_machine_without_a_gpu_installs_the_cpu_build_and_no_cuda_index(tmp_path, machine):
    code, err, calls, torch = run_setup(tmp_path, gpu=False, machine=machine, torch="none")
    assert code == 0, err
    assert torch == "cpu"
    assert [call.split()[-1] for call in torch_installs(calls)] == [CPU_TORCH]
    assert not any("--index-url" in call for call in calls)
    assert calls[-1] == "tpserve prepare"


def test_a_gb10_gets_a_cuda_build_from_pytorchs_index_and_checks_it_sees_the_gpu(tmp_path):
    code, err, calls, torch = run_setup(tmp_path, gpu=True, machine="aarch64", torch="none")
    assert code == 0, err
    assert torch == "cuda"
    (install,) = torch_installs(calls)
    assert GB10_INDEX in install and install.endswith(CPU_TORCH)
    checks = [i for i, call in enumerate(calls) if "cuda.is_available" in call]
    assert checks and checks[-1] > calls.index(install)  # checked after installing


def test_an_x86_gpu_machine_gets_a_cuda_build_too(tmp_path):
    code, err, calls, torch = run_setup(tmp_path, gpu=True, machine="x86_64", torch="none")
    assert code == 0, err
    assert torch == "cuda" and X86_INDEX in torch_installs(calls)[0]


def test_a_cpu_torch_left_in_the_venv_is_replaced_on_a_gpu_machine(tmp_path):
    code, err, calls, torch = run_setup(tmp_path, gpu=True, machine="aarch64", torch="cpu")
    assert code == 0, err
    assert torch == "cuda"
    assert "cannot use this machine's GPU; replacing it" in err
    uninstall = next(i for i, call in enumerate(calls) if "pip uninstall" in call)
    assert uninstall < calls.index(torch_installs(calls)[0])


def test_a_cuda_build_the_driver_cannot_run_fails_naming_the_driver_and_leaves_no_torch(tmp_path):
    code, err, calls, torch = run_setup(tmp_path, gpu=True, machine="aarch64", torch="none", driver_ok=False)
    assert code == 1
    assert f"cannot use this machine's GPU (NVIDIA driver {DRIVER})" in err and "TPSERVE_TORCH_INDEX" in err
    assert torch == "none"  # nothing left that would serve on the CPU beside the GPU
    assert "tpserve prepare" not in calls


def test_a_torch_that_sees_the_gpu_is_kept(tmp_path):
    code, err, calls, torch = run_setup(tmp_path, gpu=True, machine="aarch64", torch="cuda")
    assert code == 0, err
    assert torch == "cuda" and torch_installs(calls) == []
    assert not any("uninstall" in call for call in calls)


def test_device_cpu_sets_up_for_the_cpu_on_a_gpu_machine(tmp_path):
    code, err, calls, torch = run_setup(
        tmp_path, gpu=True, machine="aarch64", torch="none", env={"TPSERVE_DEVICE": "cpu"}
    )
    assert code == 0, err
    assert torch == "cpu" and not any("--index-url" in call for call in calls)


def test_the_checkout_keeps_setup_executable():
    assert os.access(REPO_ROOT / "scripts" / "setup.sh", os.X_OK)
