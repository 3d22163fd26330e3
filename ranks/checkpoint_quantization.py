"""What a pre-quantized checkpoint's config.json declares, read once and refused by name unless tpserve
serves it: compressed-tensors (llm-compressor's format) with int8 weights, one scale per output channel.

Supported: `quant_method: compressed-tensors`, format `int-quantized` / `naive-quantized` (W8A8: each
weight stored as int8 [out, in] beside `weight_scale` [out, 1]) or `pack-quantized` with 8 bits
(weight-only W8A16: four int8 values to an int32 in `weight_packed`), or `mixed-precision` of those;
every config group's weights `num_bits: 8, type: int, symmetric: true, strategy: channel`. The
checkpoint's input-activation settings are not used: FBGEMM's product quantizes every input row to
int8 by its own absmax at run time (kernels/int8_linear.py), which is W8A8's per-token dynamic scheme.
Which modules are int8 is read off the tensors themselves (ranks/int8_tensors.py): the ones beside a
`weight_scale`; the rest (`ignore`, usually lm_head) are float.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tpserve.ranks.errors import ModelFileError

METHOD = "compressed-tensors"
FORMATS = ("int-quantized", "naive-quantized", "pack-quantized")
# Sections of a compressed-tensors config whose presence changes what the stored numbers mean.
UNSUPPORTED_SECTIONS = ("transform_config",)


@dataclass(frozen=True)
class CheckpointQuantization:
    """A compressed-tensors int8 checkpoint, as its config.json declares it."""

    formats: tuple[str, ...]  # the formats its groups store weights in

    def describe(self) -> str:
        return f"{METHOD} int8 ({', '.join(self.formats)}), channel scales"


def parse_quantization_config(raw, path: str | Path) -> CheckpointQuantization | None:
    """None for a float checkpoint (no quantization_config); else the checkpoint's int8 scheme, or
    ModelFileError naming what tpserve does not serve."""
    if raw is None:
        return None

    def refuse(problem: str):
        return ModelFileError(path, f"quantization_config: {problem}")

    if not isinstance(raw, dict):
        raise refuse("not a JSON object")
    method = raw.get("quant_method")
    if method != METHOD:
        raise refuse(f"quant_method {method!r} is not supported (supported: {METHOD} int8)")
    for section in UNSUPPORTED_SECTIONS:
        if raw.get(section):
            raise refuse(f"{section} is not supported (its weights are stored transformed)")
    sparsity = raw.get("sparsity_config") or {}
    if sparsity.get("format", "dense") != "dense":
        raise refuse(f"sparsity format {sparsity['format']!r} is not supported (only dense)")
    groups = raw.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise refuse("no config_groups")
    default_format = raw.get("format")
    formats = []
    for name, group in groups.items():
        if not isinstance(group, dict):
            raise refuse(f"config group {name!r} is not a JSON object")
        group_format = group.get("format") or default_format
        if group_format not in FORMATS:
            raise refuse(
                f"config group {name!r}: format {group_format!r} is not supported (supported: {', '.join(FORMATS)})"
            )
        _check_weights(group.get("weights"), f"config group {name!r}", refuse)
        _check_inputs(group.get("input_activations"), f"config group {name!r}", refuse)
        if group.get("output_activations"):
            raise refuse(f"config group {name!r}: output activation quantization is not supported")
        formats.append(group_format)
    return CheckpointQuantization(tuple(dict.fromkeys(formats)))


def _check_weights(args, where: str, refuse) -> None:
    if not isinstance(args, dict):
        raise refuse(f"{where}: no weight quantization (activation-only schemes are not supported)")
    num_bits, kind = args.get("num_bits", 8), args.get("type", "int")
    if kind != "int":
        raise refuse(f"{where}: {kind} weights (num_bits {num_bits}) are not supported, only int8")
    if num_bits != 8:
        raise refuse(f"{where}: int{num_bits} weights are not supported, only int8")
    if not args.get("symmetric", True):
        raise refuse(f"{where}: asymmetric weights (zero points) are not supported, only symmetric int8")
    strategy = args.get("strategy")
    if strategy is None:  # compressed-tensors infers it from group_size
        group_size = args.get("group_size")
        strategy = "tensor" if group_size is None else "channel" if group_size == -1 else "group"
    if strategy != "channel":
        raise refuse(
            f"{where}: weight strategy {strategy!r} is not supported, only 'channel' (one scale per row)"
        )
    if args.get("actorder"):
        raise refuse(f"{where}: actorder {args['actorder']!r} is not supported")


def _check_inputs(args, where: str, refuse) -> None:
    if args is None:  # weight-only
        return
    if not isinstance(args, dict):
        raise refuse(f"{where}: input_activations is not a JSON object")
    num_bits, kind = args.get("num_bits", 8), args.get("type", "int")
    if kind != "int" or num_bits != 8:
        raise refuse(f"{where}: {kind}{num_bits} input activations are not supported (inputs run in int8)")
