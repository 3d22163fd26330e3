"""`tpserve import-gguf`: turns a GGUF file into a Hugging Face model directory the engine loads.

The directory holds config.json, safetensors under Hugging Face tensor names (Q4_*, Q5_*, Q6_K and
Q8_0 weights in their own blocks, tpserve/gguf_blocks.py; the rest float32),
tokenizer.json, tokenizer_config.json, generation_config.json and gguf_source.json (which file it
came from, so `prepare` can tell a stale import). Other quantized tensors are dequantized with the
`gguf` package. What llama.cpp's converter did to each architecture (the llama q/k row permutation,
gemma3's norms plus one, stacked experts) is undone (tpserve/gguf_families.py says what each is).
Everything is written to a hidden sibling directory first and renamed at the end, so a crash never
leaves a half-made model behind.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import shutil
import time
from pathlib import Path
from typing import Any

import gguf

from tpserve.gguf_families import family_of, shortest_float32
from tpserve.gguf_tensors import MAX_SHARD_BYTES, plan_tensors, write_weights
from tpserve.gguf_tokenizer import build_tokenizer, build_tokenizer_config
from tpserve.ranks.errors import ModelFileError, UserError

logger = logging.getLogger(__name__)

SOURCE_FILE = "gguf_source.json"


def import_gguf(
    gguf_path: str | Path,
    out_dir: str | Path,
    *,
    progress: bool = True,
    force: bool = False,
    max_shard_bytes: int = MAX_SHARD_BYTES,
    dequantize: bool = False,
) -> Path:
    """Convert `gguf_path` into a model directory at `out_dir` and return its path.

    Weights larger than `max_shard_bytes` are split over several safetensors files with an index.
    """
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    if out_dir.exists() and not force:
        raise UserError(f"{out_dir}: already exists; pass --force to replace it")
    started = time.monotonic()
    reader = _open(gguf_path)
    metadata = read_metadata(reader)
    config = build_config(metadata, reader.tensors, gguf_path)
    family = family_of(metadata, gguf_path)
    plan = plan_tensors(reader.tensors, config, family, gguf_path, keep_blocks=not dequantize)
    tokenizer = build_tokenizer(metadata, gguf_path)

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    _remove_abandoned_staging(out_dir)
    staging = out_dir.with_name(f".{out_dir.name}.importing-{os.getpid()}")
    staging.mkdir()
    try:
        write_weights(plan, staging, gguf_path, progress, max_shard_bytes)
        tokenizer.save(str(staging / "tokenizer.json"))
        _write_json(staging / "config.json", config)
        _write_json(staging / "tokenizer_config.json", build_tokenizer_config(metadata, gguf_path))
        _write_json(staging / "generation_config.json", _generation_config(metadata))
        _write_json(staging / SOURCE_FILE, source_stamp(gguf_path))
        _publish(staging, out_dir, force)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    logger.info("imported %s into %s in %.1f s", gguf_path, out_dir, time.monotonic() - started)
    return out_dir


# 2: Q4_0, Q4_1 and Q8_0 weights kept in blocks (an import of format 1, all float32, is stale).
# 3: Q6_K, Q5_0, Q5_1, Q5_K and Q3_K weights kept in blocks too (format 2 wrote them in float32).
IMPORT_FORMAT = 3


def source_stamp(gguf_path: Path) -> dict[str, Any]:
    """What identifies the GGUF an import came from, cheaply: its name, size and change time (and
    the import's own format)."""
    stat = gguf_path.stat()
    return {
        "file": gguf_path.name,
        "size": stat.st_size,
        "mtime_ns": stat.st_mtime_ns,
        "format": IMPORT_FORMAT,
    }


def read_metadata(reader: gguf.GGUFReader) -> dict[str, Any]:
    return {name: field.contents() for name, field in reader.fields.items()}


def build_config(metadata: dict[str, Any], tensors: list[Any], gguf_path: Path) -> dict[str, Any]:
    """config.json for the model the GGUF's metadata and tensor list describe."""
    arch = metadata.get("general.architecture")
    family = family_of(metadata, gguf_path)

    def need(key: str) -> Any:
        if f"{arch}.{key}" not in metadata:
            raise ModelFileError(gguf_path, f"metadata key '{arch}.{key}' is missing")
        return metadata[f"{arch}.{key}"]

    hidden_size = need("embedding_length")
    num_heads = need("attention.head_count")
    num_kv_heads = metadata.get(f"{arch}.attention.head_count_kv", num_heads)
    if isinstance(num_kv_heads, list) or isinstance(num_heads, list):
        raise ModelFileError(gguf_path, "per-layer head counts are not supported")
    head_dim = metadata.get(f"{arch}.attention.key_length", hidden_size // num_heads)
    rotary_dim = metadata.get(f"{arch}.rope.dimension_count", head_dim)
    if rotary_dim != head_dim and not family.partial_rotary:
        raise ModelFileError(gguf_path, f"partial rotary ({rotary_dim} of {head_dim} dims) is not supported")
    names = {tensor.name for tensor in tensors}
    if "token_embd.weight" not in names:
        raise ModelFileError(gguf_path, "tensor 'token_embd.weight' is missing")
    embedding = next(tensor for tensor in tensors if tensor.name == "token_embd.weight")
    config: dict[str, Any] = {
        "architectures": [family.architecture],
        "model_type": family.model_type,
        "hidden_size": hidden_size,
        "intermediate_size": need("feed_forward_length"),
        "num_hidden_layers": need("block_count"),
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": shortest_float32(need("attention.layer_norm_rms_epsilon")),
        "rope_theta": shortest_float32(metadata.get(f"{arch}.rope.freq_base", 10000.0)),
        "max_position_embeddings": need("context_length"),
        "vocab_size": int(embedding.shape[1]),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names,
        "torch_dtype": "float32",
    }
    if family.partial_rotary:  # written even where whole: GLM-4.5's config reads half by default
        config["partial_rotary_factor"] = rotary_factor(rotary_dim, head_dim)
    scaling = metadata.get(f"{arch}.rope.scaling.type", "none")
    if scaling not in ("none", ""):
        config["rope_scaling"] = {
            "rope_type": scaling,
            "factor": shortest_float32(need("rope.scaling.factor")),
        }
        if f"{arch}.rope.scaling.original_context_length" in metadata:
            config["rope_scaling"]["original_max_position_embeddings"] = need(
                "rope.scaling.original_context_length"
            )
        if scaling == "yarn":
            for key, default in family.yarn.items():
                value = metadata.get(f"{arch}.rope.scaling.yarn_{key}", default)
                config["rope_scaling"][key] = shortest_float32(value) if isinstance(value, float) else value
    if family.extra_config is not None:
        config |= family.extra_config(metadata, {t.name: t for t in tensors}, need, gguf_path)
    for name, key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id")):
        if f"tokenizer.ggml.{key}" in metadata:
            config[name] = metadata[f"tokenizer.ggml.{key}"]
    return config


def rotary_factor(rotary_dim: int, head_dim: int) -> float:
    """The partial_rotary_factor from which transformers counts `rotary_dim` rotating dims again
    (int(head_dim * factor)): rotary_dim / head_dim, nudged up where that product falls just short."""
    factor = rotary_dim / head_dim
    while int(head_dim * factor) < rotary_dim:
        factor = math.nextafter(factor, 1.0)
    return factor


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("import-gguf", help="convert a GGUF file into a model directory")
    parser.add_argument("file", type=Path, help="the .gguf file")
    parser.add_argument("out_dir", type=Path, help="the model directory to create")
    parser.add_argument("--force", action="store_true", help="replace OUT_DIR if it exists")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument(
        "--dequantize",
        action="store_true",
        help="write every weight in float32 (a directory Hugging Face tools load), not Q4/Q8 blocks",
    )
    parser.set_defaults(run=_run)


def _run(args: argparse.Namespace) -> int:
    out_dir = import_gguf(
        args.file, args.out_dir, progress=not args.no_progress, force=args.force, dequantize=args.dequantize
    )
    print(out_dir)
    return 0


def _open(gguf_path: Path) -> gguf.GGUFReader:
    if not gguf_path.is_file():
        raise ModelFileError(gguf_path, "no such file")
    with gguf_path.open("rb") as handle:
        if handle.read(4) != b"GGUF":
            raise ModelFileError(gguf_path, "not a GGUF file (its first bytes are not 'GGUF')")
    try:
        return gguf.GGUFReader(gguf_path)
    except (ValueError, OSError, IndexError) as error:
        raise ModelFileError(gguf_path, f"cannot be read as GGUF: {error}") from error


def _generation_config(metadata: dict[str, Any]) -> dict[str, Any]:
    # Chat models end a turn with an end-of-turn token that can differ from the eos token.
    eos_ids = [
        metadata[f"tokenizer.ggml.{key}"]
        for key in ("eos_token_id", "eot_token_id", "eom_token_id")
        if f"tokenizer.ggml.{key}" in metadata
    ]
    eos_ids = list(dict.fromkeys(eos_ids))
    config: dict[str, Any] = {}
    if "tokenizer.ggml.bos_token_id" in metadata:
        config["bos_token_id"] = metadata["tokenizer.ggml.bos_token_id"]
    if eos_ids:
        config["eos_token_id"] = eos_ids[0] if len(eos_ids) == 1 else eos_ids
    if "tokenizer.ggml.padding_token_id" in metadata:
        config["pad_token_id"] = metadata["tokenizer.ggml.padding_token_id"]
    return config


def _publish(staging: Path, out_dir: Path, force: bool) -> None:
    if not out_dir.exists():
        try:
            staging.rename(out_dir)
        except OSError as error:
            # Another import finished first (two ranks preparing at once): theirs stands.
            raise UserError(f"{out_dir}: already exists; pass --force to replace it") from error
        return
    if not force:
        raise UserError(f"{out_dir}: already exists; pass --force to replace it")
    retired = out_dir.with_name(f".{out_dir.name}.retired-{os.getpid()}")
    out_dir.rename(retired)
    staging.rename(out_dir)
    shutil.rmtree(retired, ignore_errors=True)


def _remove_abandoned_staging(out_dir: Path) -> None:
    # A killed import leaves its hidden staging directory behind; its process id says whether the
    # import is still running (another rank preparing the same model) or long gone.
    for staging in out_dir.parent.glob(f".{out_dir.name}.importing-*"):
        pid = staging.name.rsplit("-", 1)[-1]
        if pid.isdigit() and (int(pid) == os.getpid() or not _is_running(int(pid))):
            shutil.rmtree(staging, ignore_errors=True)


def _is_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _write_json(path: Path, value: dict[str, Any]) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
