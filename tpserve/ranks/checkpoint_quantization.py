"""What a pre-quantized checkpoint's config.json declares, read once and refused by name unless tpserve
serves it: compressed-tensors (llm-compressor's format) with int8 weights, one scale per output
channel; int4 weights, one scale (and zero point) per group of inputs or per output channel; or fp8
weights, one scale per tensor or per output channel.

Supported: `quant_method: compressed-tensors`, and in every config group one of
- int8: format `int-quantized` / `naive-quantized` (W8A8: each weight stored as int8 [out, in] beside
  `weight_scale` [out, 1]) or `pack-quantized` with 8 bits (weight-only W8A16: four int8 values to
  an int32 in `weight_packed`); weights `num_bits: 8, type: int, symmetric: true, strategy: channel`
  (tpserve/ranks/int8_tensors.py);
- int4: format `pack-quantized` with 4 bits (W4A16: eight values to an int32), weights `num_bits: 4,
  type: int, strategy: group` (any group_size; multiples of 32 are served as stored, others
  dequantized) or `strategy: channel`, symmetric or not (`weight_zero_point`) (tpserve/ranks/int4_tensors.py);
- fp8: format `float-quantized` / `naive-quantized`, weights `num_bits: 8, type: float, symmetric:
  true, strategy: tensor` or `channel`, served in fp8 by torch._scaled_mm on a GPU of sm_90 or newer
  in bfloat16, dequantized at load elsewhere (tpserve/ranks/fp8_tensors.py, tpserve/ranks/packing.py);
each group naming its format, or all the checkpoint's. Refused by name: other bit widths and types
(int2, nvfp4), other strategies (block, tensor for ints, group for int8 and fp8), asymmetric int8 or
fp8, activation order (`actorder`; `g_idx` tensors at load), dynamic weight scales, transforms,
sparsity. The checkpoint's input-activation settings are not used: the int8 and 4-bit products
quantize every input row by its own absmax at run time (tpserve/kernels/int8_linear.py,
tpserve/kernels/q4_linear.py), and fp8 weights compute in float (on a GPU, each input row in fp8 by its
own absmax: tpserve/kernels/fp8_linear.py).
Which modules are quantized is read off the tensors themselves: the ones beside a `weight_scale`;
the rest (`ignore`, usually lm_head) are float.

Also supported, int4 only (tpserve/ranks/gptq_tensors.py): `quant_method: gptq` with `bits: 4`, `desc_act:
false`, `checkpoint_format: gptq` (v1) or `gptq_v2` and a group_size (or -1); `quant_method: awq`
with `bits: 4`, `version: gemm`, `zero_point: true` and a group_size (or -1). Refused by name: other
bits, activation order, the marlin format, GPTQModel's per-module `dynamic`, other AWQ versions, AWQ
without zero points. Their quantized modules are the ones with a `qweight`. An older GPTQ checkpoint
may declare its scheme in AutoGPTQ's quantize_config.json instead (tpserve/ranks/model_config.py reads it).

Also `quant_method: mxfp4` (gpt-oss's experts, tpserve/ranks/mxfp4.py): dequantized at load; which tensors
it covers is read off the checkpoint (`*_blocks` beside `*_scales`), not `modules_to_not_convert`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tpserve.ranks.errors import ModelFileError

METHOD = "compressed-tensors"
GPTQ = "gptq"
GPTQ_FORMATS = ("gptq", "gptq_v2")  # v1 stores each zero point less one, v2 as it is
AWQ = "awq"
MXFP4 = "mxfp4"
FORMATS = ("int-quantized", "naive-quantized", "pack-quantized", "float-quantized")
# Sections of a compressed-tensors config whose presence changes what the stored numbers mean.
UNSUPPORTED_SECTIONS = ("transform_config",)
# (type, num_bits) -> the kind of weight it is, its strategies and the formats storing it.
KINDS = {
    ("int", 8): ("int8", ("channel",), ("int-quantized", "naive-quantized", "pack-quantized")),
    ("int", 4): ("int4", ("group", "channel"), ("pack-quantized",)),
    ("float", 8): ("fp8", ("tensor", "channel"), ("float-quantized", "naive-quantized")),
}


@dataclass(frozen=True)
class CheckpointQuantization:
    """A compressed-tensors int8, int4 or fp8 checkpoint, or a GPTQ or AWQ int4 one, as its config.json
    declares it."""

    formats: tuple[str, ...]  # the formats its groups store weights in
    kinds: tuple[str, ...] = ("int8",)  # its groups' weights: "int8", "int4", "fp8"
    strategies: tuple[str, ...] = ("channel",)  # "channel", "tensor" or "group <size>"
    method: str = METHOD  # or GPTQ, AWQ
    # GPTQ's and AWQ's inputs per scale, -1 for all (compressed-tensors': read off the tensors)
    group_size: int = 0

    def describe(self) -> str:
        return (
            f"{self.method} {', '.join(self.kinds)} ({', '.join(self.formats)}), "
            f"{', '.join(self.strategies)} scales"
        )


def parse_quantization_config(raw, path: str | Path) -> CheckpointQuantization | None:
    """None for a float checkpoint (no quantization_config); else the checkpoint's scheme, or
    ModelFileError naming what tpserve does not serve."""
    if raw is None:
        return None

    def refuse(problem: str):
        return ModelFileError(path, f"quantization_config: {problem}")

    if not isinstance(raw, dict):
        raise refuse("not a JSON object")
    method = raw.get("quant_method")
    if method == GPTQ:
        return _parse_gptq(raw, refuse)
    if method == AWQ:
        return _parse_awq(raw, refuse)
    if method == MXFP4:  # e2m1 values, a power-of-two scale per 32
        return CheckpointQuantization((MXFP4,), (MXFP4,), ("group 32",), MXFP4, 32)
    if method != METHOD:
        raise refuse(
            f"quant_method {method!r} is not supported "
            f"(supported: {METHOD} int8, int4 and fp8; {GPTQ} and {AWQ} int4; {MXFP4})"
        )
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
    formats, kinds, strategies = [], [], []
    for name, group in groups.items():
        if not isinstance(group, dict):
            raise refuse(f"config group {name!r} is not a JSON object")
        group_format = group.get("format") or default_format
        if group_format not in FORMATS:
            raise refuse(
                f"config group {name!r}: format {group_format!r} is not supported (supported: {', '.join(FORMATS)})"
            )
        where = f"config group {name!r}"
        kind, strategy, kind_formats = _check_weights(group.get("weights"), where, refuse)
        if group_format not in kind_formats:
            raise refuse(
                f"{where}: {kind} weights need format {' or '.join(map(repr, kind_formats))}, not {group_format!r}"
            )
        _check_inputs(group.get("input_activations"), where, kind, refuse)
        if group.get("output_activations"):
            raise refuse(f"{where}: output activation quantization is not supported")
        formats.append(group_format)
        kinds.append(kind)
        strategies.append(strategy)
    return CheckpointQuantization(*(tuple(dict.fromkeys(values)) for values in (formats, kinds, strategies)))


def _check_weights(args, where: str, refuse) -> tuple[str, str, tuple[str, ...]]:
    """The group's weight kind, strategy in words and the formats storing that kind; or refused by name."""
    if not isinstance(args, dict):
        raise refuse(f"{where}: no weight quantization (activation-only schemes are not supported)")
    num_bits, kind = args.get("num_bits", 8), args.get("type", "int")
    if (kind, num_bits) not in KINDS:
        raise refuse(
            f"{where}: {kind} weights (num_bits {num_bits}) are not supported, only int8, int4 and float8"
            if kind != "int"
            else f"{where}: int{num_bits} weights are not supported, only int8 and int4"
        )
    name, supported, kind_formats = KINDS[kind, num_bits]
    if name != "int4" and not args.get("symmetric", True):
        raise refuse(f"{where}: asymmetric weights (zero points) are not supported in {name}, only symmetric")
    strategy = args.get("strategy")
    group_size = args.get("group_size")
    if strategy is None:  # compressed-tensors infers it from group_size
        strategy = "tensor" if group_size is None else "channel" if group_size == -1 else "group"
    if strategy not in supported:
        raise refuse(
            f"{where}: {name} weight strategy {strategy!r} is not supported, only {' or '.join(map(repr, supported))}"
        )
    if strategy == "group" and not (isinstance(group_size, int) and group_size > 0):
        raise refuse(f"{where}: strategy 'group' with group_size {group_size!r}, not a positive integer")
    if args.get("actorder"):
        raise refuse(f"{where}: actorder {args['actorder']!r} is not supported")
    if args.get("dynamic"):
        raise refuse(f"{where}: dynamic weight scales are not supported (the file must store them)")
    return name, f"group {group_size}" if strategy == "group" else strategy, kind_formats


def _check_inputs(args, where: str, weights: str, refuse) -> None:
    """Input activations are quantized by the products' own rule (or not at all: fp8 weights
    compute in float), so any 8-bit scheme of them is accepted and not used."""
    if args is None:  # weight-only
        return
    if not isinstance(args, dict):
        raise refuse(f"{where}: input_activations is not a JSON object")
    num_bits, kind = args.get("num_bits", 8), args.get("type", "int")
    if num_bits != 8 or kind not in (("int", "float") if weights == "fp8" else ("int",)):
        raise refuse(f"{where}: {kind}{num_bits} input activations are not supported (inputs run in int8)")


def _parse_gptq(raw: dict, refuse) -> CheckpointQuantization:
    """AutoGPTQ's (and GPTQModel's, optimum's) v1 format, or GPTQModel's v2, with 4 bits and the
    inputs in order (tpserve/ranks/gptq_tensors.py)."""
    if raw.get("bits") != 4:
        raise refuse(f"gptq bits {raw.get('bits')!r} are not supported, only 4")
    if raw.get("desc_act"):
        raise refuse("gptq desc_act true (activation order) is not supported")
    checkpoint_format = raw.get("checkpoint_format", GPTQ)
    if checkpoint_format not in GPTQ_FORMATS or raw.get("is_marlin_format"):
        shown = "marlin" if raw.get("is_marlin_format") else checkpoint_format
        raise refuse(f"gptq checkpoint_format {shown!r} is not supported, only 'gptq' (v1) or 'gptq_v2'")
    if raw.get("dynamic"):
        raise refuse("gptq dynamic (per-module bits or group sizes) is not supported")
    return _int4(GPTQ, checkpoint_format, raw.get("group_size"), refuse)


def _parse_awq(raw: dict, refuse) -> CheckpointQuantization:
    """AutoAWQ's GEMM format with 4 bits and zero points (tpserve/ranks/gptq_tensors.py)."""
    bits = raw.get("bits", raw.get("w_bit"))
    if bits != 4:
        raise refuse(f"awq bits {bits!r} are not supported, only 4")
    version = str(raw.get("version", "gemm")).lower()
    if version != "gemm":
        raise refuse(f"awq version {version!r} is not supported, only 'gemm'")
    if not raw.get("zero_point", True):
        raise refuse("awq zero_point false is not supported, only zero points")
    return _int4(AWQ, version, raw.get("group_size", raw.get("q_group_size")), refuse)


def _int4(method: str, fmt: str, group_size, refuse) -> CheckpointQuantization:
    """GPTQ's or AWQ's int4 scheme with `group_size` inputs per scale (-1: all of them)."""
    if (
        not isinstance(group_size, int)
        or isinstance(group_size, bool)
        or not (group_size > 0 or group_size == -1)
    ):
        raise refuse(f"{method} group_size {group_size!r} is not a positive integer or -1")
    strategy = "channel" if group_size == -1 else f"group {group_size}"
    return CheckpointQuantization((fmt,), ("int4",), (strategy,), method, group_size)
