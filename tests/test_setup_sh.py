"""scripts/setup.sh on the machines it meets, run for real against stubs on PATH: `nvidia-smi` (a
GPU or none, its driver's CUDA version and the GPU's compute capability), `uname` (x86-64 or a
GB10's aarch64) and a .venv python whose pip records what it was asked to install. Like the real
index, the stub pip finds torch 2.13.0 only on the CUDA wheel indexes PyTorch publishes for it
(cu126, cu130, cu132), and a CUDA build sees the GPU only when the driver supports its CUDA version:
a wrong index fails set-up here as it would on the machine."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
CPU_TORCH = "torch==2.13.0"
INDEX = "https://download.pytorch.org/whl/"
DRIVER = "580.95.05"

# A .venv python: `-c` snippets answer from the torch recorded in $STUB_TORCH ("none", "cpu" or
# "cuda X.Y"; a CUDA build sees the GPU only when X.Y is at most $STUB_CUDA, the driver's); pip
# records its calls and installs a CUDA build from a CUDA wheel index that has torch 2.13.0, a CPU
# build from the registry (whose aarch64 wheel is CPU-only), and refuses any other index as pip does.
STUB_PYTHON = r"""#!/usr/bin/env bash
echo "python $*" >> "$STUB_LOG"
torch=$(cat "$STUB_TORCH")
if [ "$1" = -c ]; then
    case "$2" in
        *cuda.is_available*)
            [ "${torch%% *}" = cuda ] || exit 1
            build=${torch#cuda }
            [ "$(printf '%s\n%s\n' "$build" "$STUB_CUDA" | sort -V | head -n 1)" = "$build" ]; exit $? ;;
        *torch.__version__*) [ "$torch" != none ] || exit 1; echo "torch 2.13.0 ($torch)"; exit 0 ;;
        *"import torch"*) [ "$torch" != none ]; exit $? ;;
    esac
    exit 0
fi
if [ "$1 $2" = "-m pip" ]; then
    case " $* " in
        *" uninstall "*) echo none > "$STUB_TORCH" ;;
        *" --index-url "*torch==*)
            case " $* " in
                *" https://download.pytorch.org/whl/cu126 "*) echo "cuda 12.6" > "$STUB_TORCH" ;;
                *" https://download.pytorch.org/whl/cu130 "*) echo "cuda 13.0" > "$STUB_TORCH" ;;
                *" https://download.pytorch.org/whl/cu132 "*) echo "cuda 13.2" > "$STUB_TORCH" ;;
                *) echo "ERROR: Could not find a version that satisfies the requirement torch==2.13.0" \
                    "(from versions: none)" >&2; exit 1 ;;
            esac ;;
        *" torch=="*) echo cpu > "$STUB_TORCH" ;;
    esac
fi
exit 0
"""
# nvidia-smi as drivers print it: the table's header names the CUDA version the driver supports;
# an older nvidia-smi knows no compute_cap field ($STUB_CAPS empty).
NVIDIA_SMI_WITH_GPU = f"""#!/usr/bin/env bash
case "$*" in
    "") echo "| NVIDIA-SMI {DRIVER}   Driver Version: {DRIVER}   ${{STUB_CUDA:+CUDA Version: $STUB_CUDA}} |" ;;
    -L) echo "GPU 0: NVIDIA H200 (UUID: GPU-0)" ;;
    *driver_version*) echo "{DRIVER}" ;;
    *compute_cap*)
        [ -n "$STUB_CAPS" ] || {{ echo 'Field "compute_cap" is not a valid field to query.'; exit 2; }}
        printf '%b\\n' "$STUB_CAPS" ;;
esac
"""
NVIDIA_SMI_WITHOUT_GPU = """#!/usr/bin/env bash
echo "No devices were found"; exit 6
"""


def _executable(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(0o755)


def run_setup(
    tmp_path: Path, *, gpu: bool, machine: str, torch: str, cuda: str = "13.0", caps: str = "9.0", env=None
):
    """Run a copy of setup.sh in a bare checkout, on a driver supporting CUDA `cuda` ("" where it
    does not say) and GPUs of compute capabilities `caps` ("\\n" between GPUs; "" where nvidia-smi
    cannot say); returns (exit code, stderr, python calls, torch after)."""
    repo, stubs = tmp_path / "repo", tmp_path / "bin"
    (repo / "scripts").mkdir(parents=True)
    for script in ("setup.sh", "torch_choice.sh"):
        shutil.copy(REPO_ROOT / "scripts" / script, repo / "scripts" / script)
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
        "STUB_CUDA": cuda,
        "STUB_CAPS": caps,
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


def cuda_index_used(calls: list[str]) -> str:
    """The CUDA wheel index of the one torch install, as cu126 etc."""
    (install,) = torch_installs(calls)
    assert install.endswith(CPU_TORCH)
    words = install.split()
    return words[words.index("--index-url") + 1].removeprefix(INDEX)


@pytest.mark.parametrize(
    ("machine", "cuda", "caps", "index"),
    [
        ("x86_64", "13.0", "9.0", "cu130"),  # an H200 on a 580 driver
        ("x86_64", "13.2", "10.0", "cu130"),  # a B200 on a newer driver: 13.0 is the newest stable build
        ("x86_64", "12.8", "9.0", "cu126"),  # an H100 on a 570 driver: torch 2.13 has no cu128
        ("x86_64", "12.6", "8.6", "cu126"),
        ("x86_64", "13.0", "7.0", "cu126"),  # a V100: the CUDA 13 builds start at Turing (7.5)
        ("x86_64", "13.0", "9.0\\n7.0", "cu126"),  # every GPU must be covered
        ("x86_64", "13.0", "", "cu130"),  # an nvidia-smi that cannot say: the driver decides
        ("aarch64", "13.0", "12.1", "cu130"),  # a GB10
        ("aarch64", "13.2", "12.1", "cu130"),
        ("aarch64", "12.9", "9.0", "cu126"),  # a GH200 on an older driver
    ],
)
def test_a_gpu_machine_gets_the_cuda_build_its_driver_and_gpu_can_run(tmp_path, machine, cuda, caps, index):
    code, err, calls, torch = run_setup(
        tmp_path, gpu=True, machine=machine, torch="none", cuda=cuda, caps=caps
    )
    assert code == 0, err
    assert cuda_index_used(calls) == index
    assert torch.startswith("cuda")  # the stub's GPU check passed
    install = calls.index(torch_installs(calls)[0])
    checks = [i for i, call in enumerate(calls) if "cuda.is_available" in call]
    assert checks and checks[-1] > install  # checked after installing
    assert f"for CUDA {index[2:4]}.{index[4:]} (the driver supports CUDA {cuda})" in err


@pytest.mark.parametrize(
    ("machine", "cuda", "caps"),
    [
        ("x86_64", "12.4", "9.0"),  # older than every build
        ("x86_64", "12.8", "12.0"),  # a Blackwell GPU on a 570 driver: 12.6 stops at Hopper
        ("aarch64", "12.9", "12.1"),  # a GB10 on a driver before CUDA 13
        ("aarch64", "13.0", "7.5"),  # the aarch64 builds start at Ampere
    ],
)
def test_no_build_that_fits_is_refused_naming_the_driver_and_the_builds(tmp_path, machine, cuda, caps):
    code, err, calls, torch = run_setup(
        tmp_path, gpu=True, machine=machine, torch="cpu", cuda=cuda, caps=caps
    )
    assert code == 1
    assert f"no CUDA build of torch 2.13.0 suits this machine: its NVIDIA driver supports CUDA {cuda}" in err
    assert f"compute capability {caps} ({machine})" in err
    assert "CUDA builds 13.0, 12.6" in err and "TPSERVE_TORCH_INDEX" in err
    assert torch_installs(calls) == [] and not any("uninstall" in call for call in calls)
    assert torch == "cpu"  # refused before anything changed


def test_a_driver_that_does_not_say_its_cuda_version_is_refused(tmp_path):
    code, err, calls, _ = run_setup(tmp_path, gpu=True, machine="x86_64", torch="none", cuda="")
    assert code == 1
    assert "does not say which CUDA version" in err and "TPSERVE_TORCH_INDEX" in err
    assert torch_installs(calls) == []


@pytest.mark.parametrize(("cuda", "caps", "index"), [("13.2", "9.0", "cu132"), ("12.8", "12.0", "cu126")])
def test_torch_index_overrides_the_choice_even_where_it_refuses(tmp_path, cuda, caps, index):
    env = {"TPSERVE_TORCH_INDEX": INDEX + index}
    code, err, calls, torch = run_setup(
        tmp_path, gpu=True, machine="x86_64", torch="none", cuda=cuda, caps=caps, env=env
    )
    assert code == 0, err
    assert cuda_index_used(calls) == index and torch == f"cuda {index[2:4]}.{index[4:]}"


def test_a_cpu_torch_left_in_the_venv_is_replaced_on_a_gpu_machine(tmp_path):
    code, err, calls, torch = run_setup(tmp_path, gpu=True, machine="aarch64", torch="cpu", caps="12.1")
    assert code == 0, err
    assert torch == "cuda 13.0"
    assert "cannot use this machine's GPU; replacing it" in err
    uninstall = next(i for i, call in enumerate(calls) if "pip uninstall" in call)
    assert uninstall < calls.index(torch_installs(calls)[0])


def test_a_cuda_build_the_driver_cannot_run_fails_naming_the_driver_and_leaves_no_torch(tmp_path):
    env = {"TPSERVE_TORCH_INDEX": INDEX + "cu132"}  # newer than the driver's CUDA 13.0
    code, err, calls, torch = run_setup(
        tmp_path, gpu=True, machine="aarch64", torch="none", caps="12.1", env=env
    )
    assert code == 1
    assert f"cannot use this machine's GPU (NVIDIA driver {DRIVER}, CUDA 13.0)" in err
    assert "TPSERVE_TORCH_INDEX" in err
    assert torch == "none"  # nothing left that would serve on the CPU beside the GPU
    assert "tpserve prepare" not in calls


def test_a_torch_that_sees_the_gpu_is_kept(tmp_path):
    code, err, calls, torch = run_setup(tmp_path, gpu=True, machine="aarch64", torch="cuda 13.0")
    assert code == 0, err
    assert torch == "cuda 13.0" and torch_installs(calls) == []
    assert not any("uninstall" in call for call in calls)


def test_device_cpu_sets_up_for_the_cpu_on_a_gpu_machine(tmp_path):
    code, err, calls, torch = run_setup(
        tmp_path, gpu=True, machine="aarch64", torch="none", env={"TPSERVE_DEVICE": "cpu"}
    )
    assert code == 0, err
    assert torch == "cpu" and not any("--index-url" in call for call in calls)


def test_the_checkout_keeps_setup_executable():
    assert os.access(REPO_ROOT / "scripts" / "setup.sh", os.X_OK)


def torch_choice(gpu: str, driver: str = "", caps: str = "", machine: str = "x86_64") -> str:
    """scripts/torch_choice.sh's torch_choice, called alone (its functions run no command)."""
    script = REPO_ROOT / "scripts" / "torch_choice.sh"
    done = subprocess.run(
        ["bash", "-c", f'. "{script}" && torch_choice "$@"', "choice", gpu, driver, caps, machine],
        capture_output=True, text=True, check=True, env={"PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    return done.stdout.strip()


@pytest.mark.parametrize(
    "gpu, driver, caps, machine, choice",
    [
        ("no", "", "", "x86_64", "cpu"),  # no nvidia-smi, or one seeing no GPU
        ("no", "13.0", "9.0", "x86_64", "cpu"),  # TPSERVE_DEVICE=cpu on a GPU machine
        ("yes", "13.0", "9.0", "x86_64", "cuda 13.0 cu130"),  # an H200 on a new driver
        ("yes", "12.8", "9.0", "x86_64", "cuda 12.6 cu126"),  # the driver cannot run 13.0
        ("yes", "13.0", "12.1", "aarch64", "cuda 13.0 cu130"),  # a GB10
        ("yes", "12.9", "12.1", "aarch64", "none"),  # 12.6 stops at Hopper
        ("yes", "12.4", "8.0", "x86_64", "none"),  # older than every build
        ("yes", "13.0", "7.0 9.0", "x86_64", "cuda 12.6 cu126"),  # a V100 beside an H100: 13.0 dropped 7.0
    ],
)
def test_the_torch_choice_is_a_function_of_what_the_machine_says(gpu, driver, caps, machine, choice):
    assert torch_choice(gpu, driver, caps, machine) == choice
