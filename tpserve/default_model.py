"""Where the shipped default model (SmolLM2-135M-Instruct) lives once prepared: paths only.

Kept apart from tpserve/prepare.py, which imports the GGUF reader, so that what only needs the
path (`tpserve generate`, the GPU check) starts on a machine without the `gguf` package.
"""

from __future__ import annotations

from pathlib import Path

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def default_models_dir() -> Path:
    return Path.home() / ".cache" / "tpserve" / "models"


def default_model_dir(models_dir: str | Path | None = None) -> Path:
    """Where the default model's directory lives: under `models_dir`, or ~/.cache/tpserve/models."""
    return Path(models_dir or default_models_dir()) / DEFAULT_MODEL_NAME
