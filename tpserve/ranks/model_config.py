"""The model's shape and family, read once from a Hugging Face config.json and validated."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path

from tpserve.kernels.rope_scaling import RopeScaling
from tpserve.ranks.checkpoint_quantization import CheckpointQuantization, parse_quantization_config
from tpserve.ranks.errors import ModelFileError
from tpserve.ranks.gemma3_config import Gemma3Shape, global_and_local_rope, parse_gemma3
from tpserve.ranks.gemma3_vision_config import (
    GEMMA3_VL_ARCHITECTURES,
    Gemma3VisionConfig,
    gemma3_text_settings,
    parse_gemma3_vision_config,
)
from tpserve.ranks.glm4v_vision_config import (
    GLM4V_ARCHITECTURES,
    Glm4vVisionConfig,
    parse_glm4v_vision_config,
)
from tpserve.ranks.idefics3_config import (
    IDEFICS3_ARCHITECTURES,
    TEXT_DEFAULTS,
    Idefics3VisionConfig,
    parse_idefics3_config,
)
from tpserve.ranks.moe_config import MoeConfig, parse_moe_config
from tpserve.ranks.qwen3_vision_config import (
    QWEN3_VL_ARCHITECTURES,
    Qwen3VisionConfig,
    parse_qwen3_vision_config,
)
from tpserve.ranks.qwen_vision_config import QWEN_VL_ARCHITECTURES, QwenVisionConfig, parse_qwen_vision_config
from tpserve.ranks.unsupported import (
    PARTIAL_ROTARY,
    layer_windows,
    refuse_architecture,
    refuse_unimplemented,
)
from tpserve.ranks.vision_config import VISION_ARCHITECTURES, VisionConfig, parse_vision_config

# Every family here is a Llama-style decoder; they differ in biases, q/k norms, fused weights and
# (Mixtral, Qwen3-MoE, Qwen2-MoE, gpt-oss, GLM-4.5) a mixture of experts in place of the MLP.
FAMILIES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    # q/k/v and gate/up stored fused (tpserve/ranks/fused_tensors.py); Phi-4-mini's partial rotary
    "Phi3ForCausalLM": "phi3",
    "MixtralForCausalLM": "mixtral",  # mixtures of experts (tpserve/ranks/moe_config.py)
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Qwen2MoeForCausalLM": "qwen2_moe",  # a shared expert, its output gated by a sigmoid
    # local and global layers, GeGLU, four norms a layer (tpserve/ranks/models/gemma3.py)
    "Gemma3ForCausalLM": "gemma3",
    # attention sinks, sliding and full layers, biased experts (tpserve/ranks/models/gpt_oss.py)
    "GptOssForCausalLM": "gpt_oss",
    # grouped sigmoid routing, a shared expert, partial rotary (tpserve/ranks/moe_config.py)
    "Glm4MoeForCausalLM": "glm4_moe",
}
ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")
# A vision-language checkpoint's text_config names its decoder by model_type only.
TEXT_MODEL_TYPES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2"}
# transformers' LlamaConfig defaults, which llava-hf text_configs leave out.
LLAMA_DEFAULTS = {
    "vocab_size": 32000,
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
}


@dataclass(frozen=True)
class ModelConfig:
    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    architecture: str = ""
    # a vision-language model's tower, projector and media tokens (a Qwen-VL's: mrope in the text model)
    vision: (
        VisionConfig
        | QwenVisionConfig
        | Qwen3VisionConfig
        | Idefics3VisionConfig
        | Glm4vVisionConfig
        | Gemma3VisionConfig
        | None
    ) = None
    quantization: CheckpointQuantization | None = None  # a pre-quantized (int8) checkpoint's scheme
    sliding_window: int | None = None  # a window some layers attend within (tpserve/ranks/unsupported.py)
    windows: tuple[int, ...] = ()  # each layer's window, 0 for a full-attention layer (() none slides)
    moe: MoeConfig | None = None  # a mixture of experts' routing shape
    gemma3: Gemma3Shape | None = None  # Gemma 3's own keys (tpserve/ranks/models/gemma3.py)
    o_bias: bool = False  # a bias on o_proj (gpt-oss), added once after the reduce
    sinks: bool = False  # a sink logit per query head in every softmax (gpt-oss)
    # the leading dims of a head that rotate (GLM-4.5's half, Phi-4-mini's 3/4; 0: all of them)
    rotary_dim: int = 0
    rotary_interleaved: bool = False  # the rotating dims pair as (2i, 2i + 1) (GLM-4.1V's text model)

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads


def load_model_config(model_dir: str | Path) -> ModelConfig:
    path = Path(model_dir) / "config.json"
    if not Path(model_dir).is_dir():
        raise ModelFileError(model_dir, "not a model directory (run `tpserve prepare` for the default model)")
    raw = _json_object(path)
    # AutoGPTQ's own quantize_config.json, which older GPTQ checkpoints carry instead of a
    # quantization_config in config.json (and which names no quant_method)
    quantize_config = Path(model_dir) / "quantize_config.json"
    if "quantization_config" not in raw and quantize_config.exists():
        raw = raw | {"quantization_config": {"quant_method": "gptq"} | _json_object(quantize_config)}
    return parse_model_config(raw, path)


def _json_object(path: Path) -> dict:
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise ModelFileError(path, "missing") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ModelFileError(path, f"not valid JSON ({error})") from None
    if not isinstance(raw, dict):
        raise ModelFileError(path, "not a JSON object")
    return raw


def parse_model_config(raw: dict, path: str | Path = "config.json") -> ModelConfig:
    config = _parse_model(raw, path)
    text = raw.get("text_config") or {}
    quantization = raw.get("quantization_config", text.get("quantization_config"))
    return replace(config, quantization=parse_quantization_config(quantization, path))


def _parse_model(raw: dict, path: str | Path) -> ModelConfig:
    architectures = raw.get("architectures") or []
    qwen_vl = next((a for a in architectures if a in QWEN_VL_ARCHITECTURES), None)
    if qwen_vl is not None:
        return _parse_qwen_vl(raw, qwen_vl, path)
    qwen3_vl = next((a for a in architectures if a in QWEN3_VL_ARCHITECTURES), None)
    if qwen3_vl is not None:
        return _parse_qwen3_vl(raw, qwen3_vl, path)
    glm4v = next((a for a in architectures if a in GLM4V_ARCHITECTURES), None)
    if glm4v is not None:
        return _parse_glm4v(raw, glm4v, path)
    if any(a in GEMMA3_VL_ARCHITECTURES for a in architectures):
        return _parse_gemma3_vl(raw, GEMMA3_VL_ARCHITECTURES[0], path)
    vision_arch = next(
        (a for a in architectures if a in VISION_ARCHITECTURES or a in IDEFICS3_ARCHITECTURES), None
    )
    if vision_arch is not None:
        return _parse_vision_language(raw, vision_arch, path)
    family = next((FAMILIES[a] for a in architectures if a in FAMILIES), None)
    if family is None:
        refuse_architecture(architectures, path)
        supported = ", ".join(
            (
                *FAMILIES,
                *VISION_ARCHITECTURES,
                *QWEN_VL_ARCHITECTURES,
                *QWEN3_VL_ARCHITECTURES,
                *IDEFICS3_ARCHITECTURES,
                *GLM4V_ARCHITECTURES,
                *GEMMA3_VL_ARCHITECTURES,
            )
        )
        raise ModelFileError(path, f"unsupported architecture {architectures!r} (supported: {supported})")
    return _parse_text(raw, family, architectures[0], path)


def _parse_vision_language(raw: dict, architecture: str, path: str | Path) -> ModelConfig:
    """LLaVA, Idefics3 and SmolVLM: the text decoder from text_config (a Llama-family model), the tower
    from vision_config (CLIP's, or SigLIP's and a pixel-shuffle connector: tpserve/ranks/siglip_vision.py)."""
    idefics3 = architecture in IDEFICS3_ARCHITECTURES
    text = {**(TEXT_DEFAULTS if idefics3 else {}), **(raw.get("text_config") or {})}
    model_type = text.get("model_type", "llama")
    if model_type not in TEXT_MODEL_TYPES:
        raise ModelFileError(
            path, f"text model {model_type!r} is not supported (supported: {', '.join(TEXT_MODEL_TYPES)})"
        )
    if model_type == "llama":
        text = {**LLAMA_DEFAULTS, **text}
    for key in ("eos_token_id", "bos_token_id", "tie_word_embeddings"):
        if key not in text and key in raw:
            text[key] = raw[key]
    config = _parse_text(text, TEXT_MODEL_TYPES[model_type], architecture, path)
    parse = parse_idefics3_config if idefics3 else parse_vision_config
    return replace(config, vision=parse(raw, config.hidden_size, path))


def _parse_qwen_vl(raw: dict, architecture: str, path: str | Path) -> ModelConfig:
    """Qwen2.5-VL: a Qwen2 decoder whose rotary is multimodal (tpserve/ranks/mrope.py), and the windowed ViT.
    transformers 5 nests the decoder's keys in text_config; 4 wrote them at the top level, the mrope
    sections as a rope_scaling of type "mrope" (no scaling: the plain rotary, turned per axis)."""
    text = dict(raw.get("text_config") or raw)
    for key in ("eos_token_id", "bos_token_id", "tie_word_embeddings"):
        if key not in text and key in raw:
            text[key] = raw[key]
    scaling = text.get("rope_scaling") or {}
    if scaling.get("type", scaling.get("rope_type")) in ("mrope", "default"):
        text.pop("rope_scaling")  # the sections are read below; no scaling is left
    config = _parse_text(text, "qwen2", architecture, path)
    vision = parse_qwen_vision_config(raw, {**text, "rope_scaling": scaling}, config.head_dim, path)
    if vision.out_hidden_size != config.hidden_size:
        raise ModelFileError(path, "vision_config.out_hidden_size is not the text model's hidden_size")
    return replace(config, vision=vision)


def _parse_qwen3_vl(raw: dict, architecture: str, path: str | Path) -> ModelConfig:
    """Qwen3-VL: a Qwen3 decoder (q and k norms) whose rotary is multimodal with interleaved sections and
    whose first layers take the tower's deepstack features, and the ViT (tpserve/ranks/qwen3_vision.py)."""
    text = dict(raw.get("text_config") or {})
    for key in ("eos_token_id", "bos_token_id", "tie_word_embeddings"):
        if key not in text and key in raw:
            text[key] = raw[key]
    config = _parse_text(text, "qwen3", architecture, path)
    vision = parse_qwen3_vision_config(raw, text, config.head_dim, path)
    if vision.out_hidden_size != config.hidden_size:
        raise ModelFileError(path, "vision_config.out_hidden_size is not the text model's hidden_size")
    if vision.num_deepstack > config.num_layers:
        raise ModelFileError(path, "more deepstack mergers than text layers to add their features to")
    return replace(config, vision=vision)


def _parse_glm4v(raw: dict, architecture: str, path: str | Path) -> ModelConfig:
    """GLM-4.1V: a GLM-4 decoder (q/k/v biases, a norm on the attention's and the MLP's outputs too:
    tpserve/ranks/models/glm4v.py) whose partial rotary pairs its dims interleaved and is multimodal, its
    sections in runs (t, h, w), and the ViT (tpserve/ranks/glm4v_vision.py). GLM-4.5V: the same tower
    before GLM-4.5's decoder (tpserve/ranks/moe_config.py; rotate-half over its partial rotary), its
    positions multimodal as 4.1V's. transformers 5 writes the sections in rope_parameters; a
    transformers 4 config in rope_scaling, of type "default"."""
    moe = architecture == "Glm4vMoeForConditionalGeneration"
    text = dict(raw.get("text_config") or {})
    for key in ("eos_token_id", "bos_token_id", "tie_word_embeddings"):
        if key not in text and key in raw:
            text[key] = raw[key]
    scaling = text.pop("rope_scaling", None) or {}
    if scaling.get("type", scaling.get("rope_type", "default")) != "default":
        raise ModelFileError(path, f"{architecture}: rope scaling {scaling!r} is not implemented")
    if moe:
        config = _parse_text(text, "glm4_moe", architecture, path)
    else:
        text.pop("attention_bias", None)  # Glm4vTextAttention biases q, k and v whatever it says, never o
        config = replace(_parse_text(text, "glm4v", architecture, path), rotary_interleaved=True)
    rope = {**scaling, **(text.get("rope_parameters") or {})}
    vision = parse_glm4v_vision_config(
        raw, {"rope_parameters": rope}, config.rotary_dim or config.head_dim, path, moe
    )
    if vision.out_hidden_size != config.hidden_size:
        raise ModelFileError(path, "vision_config.out_hidden_size is not the text model's hidden_size")
    return replace(config, vision=vision)


def _parse_gemma3_vl(raw: dict, architecture: str, path: str | Path) -> ModelConfig:
    """Gemma 3 with images: its text model (family gemma3, whose image tokens see each other:
    tpserve/ranks/models/gemma3.py) from text_config, the SigLIP tower and projector from vision_config
    (tpserve/ranks/gemma3_vision.py)."""
    text = gemma3_text_settings(raw)
    model_type = text.get("model_type", "gemma3_text")
    if model_type != "gemma3_text":
        raise ModelFileError(path, f"Gemma3: text model {model_type!r} is not gemma3_text")
    config = _parse_text(text, "gemma3", architecture, path)
    # transformers' Gemma3ForConditionalGeneration soft-caps no logits (its forward reads no
    # final_logit_softcapping; Google's configs set none): neither do we
    gemma3 = replace(config.gemma3, final_logit_softcapping=None)
    return replace(config, gemma3=gemma3, vision=parse_gemma3_vision_config(raw, config.hidden_size, path))


def _parse_text(raw: dict, family: str, architecture: str, path: str | Path) -> ModelConfig:

    def need(key: str, kind: type = int):
        if key not in raw:
            raise ModelFileError(path, f"missing {key!r}")
        value = raw[key]
        if kind is int and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
            raise ModelFileError(path, f"{key!r} must be a positive integer, not {value!r}")
        if kind is float and (not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0):
            raise ModelFileError(path, f"{key!r} must be a positive number, not {value!r}")
        return value

    refuse_unimplemented(raw, family, architecture, path)
    windows = layer_windows(raw, family, path)
    hidden_size = need("hidden_size")
    num_heads = need("num_attention_heads")
    num_kv_heads = raw.get("num_key_value_heads") or num_heads
    head_dim = raw.get("head_dim") or hidden_size // num_heads
    if num_heads % num_kv_heads:
        raise ModelFileError(path, f"{num_heads} attention heads do not divide into {num_kv_heads} KV heads")
    # transformers 5 writes rope_theta and the scaling inside rope_parameters.
    rope = raw.get("rope_parameters") or {}
    if family == "gemma3":  # per layer type: the global layers' here, the local base in gemma3
        rope = global_and_local_rope(raw)[0]
    rope_theta = raw.get("rope_theta") or rope.get("rope_theta", 10000.0)
    rope_scaling = raw.get("rope_scaling")
    if rope_scaling is None and rope.get("rope_type", "default") != "default":
        rope_scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
    scaling = parse_rope_scaling(_with_longrope_defaults(rope_scaling, raw), path)
    rotary_dim = _rotary_dim(raw, rope, family, head_dim, path)
    if scaling.rope_type == "longrope" and len(scaling.short_factor) != (rotary_dim or head_dim) // 2:
        raise ModelFileError(
            path,
            f"longrope's short_factor must hold {(rotary_dim or head_dim) // 2} numbers (half the rotary dims)",
        )
    eos = raw.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
    return ModelConfig(
        family=family,
        vocab_size=need("vocab_size"),
        hidden_size=hidden_size,
        intermediate_size=need("intermediate_size"),
        num_layers=need("num_hidden_layers"),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope_theta),
        rope_scaling=scaling,
        max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        qkv_bias=family in ("qwen2", "glm4v")
        or (family == "qwen2_moe" and bool(raw.get("qkv_bias", True)))
        or bool(raw.get("attention_bias", False)),
        o_bias=family == "gpt_oss" and bool(raw.get("attention_bias", False)),
        sinks=family == "gpt_oss",
        qk_norm=family in ("qwen3", "qwen3_moe", "gemma3")
        or (family == "glm4_moe" and bool(raw.get("use_qk_norm"))),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=eos_ids,
        architecture=architecture,
        sliding_window=max(windows, default=0) or None,
        windows=windows if any(windows) else (),
        moe=parse_moe_config(raw, family, need("num_hidden_layers"), path),
        gemma3=parse_gemma3(raw, path) if family == "gemma3" else None,
        rotary_dim=rotary_dim,
    )


def _rotary_dim(raw: dict, rope: dict, family: str, head_dim: int, path: str | Path) -> int:
    """The dims of a head that rotate, as transformers counts them (int(head_dim * factor)); 0 for
    all. Only GLM-4.5's and Phi-3's partial rotary is computed (tpserve/ranks/partial_rotary.py;
    transformers' default factor: GLM's half, Phi-3's one)."""
    if family not in PARTIAL_ROTARY:
        return 0  # tpserve/ranks/unsupported.py refused a partial factor
    default = PARTIAL_ROTARY[family]
    factor = raw.get("partial_rotary_factor", rope.get("partial_rotary_factor", default))
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 0 < factor <= 1:
        raise ModelFileError(path, f"partial_rotary_factor must be in (0, 1], not {factor!r}")
    dim = int(head_dim * factor)
    if dim % 2 or dim < 2:
        raise ModelFileError(path, f"partial rotary over {dim} of {head_dim} dims: not an even count")
    return 0 if dim == head_dim else dim


def _with_longrope_defaults(rope_scaling: dict | None, raw: dict) -> dict | None:
    """Phi-3's longrope (once named "su") with what transformers derives: the original context
    (config.json keeps it beside the scaling), the factor and the attention factor."""
    if not rope_scaling or rope_scaling.get("rope_type", rope_scaling.get("type")) not in ("longrope", "su"):
        return rope_scaling
    original = rope_scaling.get("original_max_position_embeddings") or raw.get(
        "original_max_position_embeddings", raw.get("max_position_embeddings", 2048)
    )
    factor = rope_scaling.get("factor") or raw.get("max_position_embeddings", original) / original
    attention_factor = rope_scaling.get("attention_factor") or (
        math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1 else 1.0
    )
    return rope_scaling | {
        "rope_type": "longrope",
        "original_max_position_embeddings": original,
        "factor": factor,
        "attention_factor": attention_factor,
        "short_factor": tuple(rope_scaling.get("short_factor") or ()),
    }


def parse_rope_scaling(raw: dict | None, path: str | Path) -> RopeScaling:
    if not raw:
        return RopeScaling()
    rope_type = raw.get("rope_type", raw.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ModelFileError(
            path, f"unsupported rope scaling {rope_type!r} (supported: {', '.join(ROPE_TYPES)})"
        )
    if rope_type == "yarn":  # DeepSeek's and others' yarn variants
        for key in ("mscale", "mscale_all_dim", "attention_factor"):
            if raw.get(key) is not None:
                raise ModelFileError(path, f"yarn's {key} {raw[key]!r} is not implemented")
    fields = {k: raw[k] for k in RopeScaling.__dataclass_fields__ if k in raw and k != "rope_type"}
    return RopeScaling(rope_type=rope_type, **fields)
