"""A tiny gpt-oss that speaks harmony as far as its files go: transformers' tiny GptOss checkpoint
(tests/tiny_hf_models.py) with a tokenizer holding the harmony special tokens, gpt-oss's own chat
template (tests/golden/gpt_oss_chat_template.jinja, as openai/gpt-oss-20b ships it) and its
generation_config's end tokens (<|return|>, <|endoftext|>, <|call|>)."""

from __future__ import annotations

import json
from pathlib import Path

from tiny_hf_models import VOCAB, write_hf_model
from tiny_models import build_tokenizer
from tokenizers import Tokenizer

HARMONY_TOKENS = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|call|>"]
# ids 0, 1, 2 as the tiny config's pad, bos and eos ids name them (gpt-oss's own: <|return|> ends)
SPECIAL_TOKENS = ["<|endoftext|>", "<|startoftext|>", "<|return|>", *HARMONY_TOKENS]
TEMPLATE = Path(__file__).parent / "golden" / "gpt_oss_chat_template.jinja"


def build_harmony_tokenizer() -> Tokenizer:
    """Byte-level BPE of the tests' vocabulary size (fewer merges make room for the special tokens)."""
    tokenizer = build_tokenizer(VOCAB, SPECIAL_TOKENS)
    assert tokenizer.get_vocab_size() == VOCAB
    return tokenizer


def write_harmony_model(out_dir: Path) -> Path:
    model_dir = write_hf_model(out_dir, "gpt-oss")
    tokenizer = build_harmony_tokenizer()
    tokenizer.save(str(model_dir / "tokenizer.json"))
    config = {"eos_token": "<|return|>", "pad_token": "<|endoftext|>", "add_bos_token": False}
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config))
    (model_dir / "chat_template.jinja").write_text(TEMPLATE.read_text())
    eos = [tokenizer.token_to_id(token) for token in ("<|return|>", "<|endoftext|>", "<|call|>")]
    generation = json.loads((model_dir / "generation_config.json").read_text())
    (model_dir / "generation_config.json").write_text(json.dumps({**generation, "eos_token_id": eos}))
    return model_dir
