"""Rebuilds a Hugging Face tokenizer (tokenizer.json, tokenizer_config.json) from a GGUF's metadata.

A GGUF carries no tokenizer.json: it stores the vocabulary, the merges, each token's type and the name
of llama.cpp's pre-tokenizer (`tokenizer.ggml.pre`). Byte-level BPE (`tokenizer.ggml.model == "gpt2"`)
is rebuilt here, its splitting rules following llama.cpp's `llama-vocab.cpp`, which is what the file
was made to be read by; a SentencePiece vocabulary ("llama") in tpserve/gguf_spm.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

from tpserve.gguf_spm import build_spm_tokenizer
from tpserve.ranks.errors import ModelFileError

# llama.cpp's token types (gguf.TokenType): CONTROL tokens are special (skipped when decoding),
# USER_DEFINED ones are matched whole in text but decoded like any other token.
_CONTROL = 3
_USER_DEFINED = 4

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# o200k's (gpt-oss, GPT-4o): llama.cpp's LLAMA_VOCAB_PRE_TYPE_GPT4O, as the original tokenizer.json says
_O200K_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclass(frozen=True)
class PreTokenizerRule:
    """How one `tokenizer.ggml.pre` value splits text before BPE runs."""

    split_regex: str | None = None  # None: GPT-2's own regex (ByteLevel with use_regex)
    isolate_digits: bool = False  # llama.cpp's "\p{N}" pass before the GPT-2 regex
    ignore_merges: bool = False  # a word already in the vocabulary is taken whole (llama 3)
    nfc: bool = False  # the original tokenizer.json normalizes to NFC (Qwen2)


PRE_TOKENIZER_RULES: dict[str, PreTokenizerRule] = {
    "default": PreTokenizerRule(),
    "gpt2": PreTokenizerRule(),
    "smollm": PreTokenizerRule(isolate_digits=True),
    "starcoder": PreTokenizerRule(isolate_digits=True),
    "refact": PreTokenizerRule(isolate_digits=True),
    "llama-bpe": PreTokenizerRule(split_regex=_LLAMA3_SPLIT, ignore_merges=True),
    "llama3": PreTokenizerRule(split_regex=_LLAMA3_SPLIT, ignore_merges=True),
    "llama-v3": PreTokenizerRule(split_regex=_LLAMA3_SPLIT, ignore_merges=True),
    "qwen2": PreTokenizerRule(split_regex=_QWEN2_SPLIT, nfc=True),
    "deepseek-r1-qwen": PreTokenizerRule(split_regex=_QWEN2_SPLIT, nfc=True),
    "gpt-4o": PreTokenizerRule(split_regex=_O200K_SPLIT),
}


def build_tokenizer(metadata: dict[str, Any], gguf_path: Path) -> Tokenizer:
    """The byte-level BPE tokenizer the GGUF describes, with its control tokens as special tokens."""
    kind = metadata.get("tokenizer.ggml.model")
    if kind == "llama":
        return build_spm_tokenizer(metadata, gguf_path)
    if kind != "gpt2":
        raise ModelFileError(
            gguf_path,
            f"tokenizer model {kind!r} is not supported ('gpt2' byte-level BPE and 'llama' SentencePiece are)",
        )
    pre_name = metadata.get("tokenizer.ggml.pre", "default")
    rule = PRE_TOKENIZER_RULES.get(pre_name)
    if rule is None:
        known = ", ".join(sorted(PRE_TOKENIZER_RULES))
        raise ModelFileError(gguf_path, f"pre-tokenizer {pre_name!r} is not supported (known: {known})")
    tokens: list[str] = _require(metadata, "tokenizer.ggml.tokens", gguf_path)
    token_types: list[int] = metadata.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    if len(token_types) != len(tokens):
        raise ModelFileError(
            gguf_path, f"{len(tokens)} tokens but {len(token_types)} token types in the tokenizer metadata"
        )

    vocab: dict[str, int] = {}
    for token_id, token in enumerate(tokens):
        # A repeated spelling keeps its first id; llama.cpp's lookups do the same.
        vocab.setdefault(token, token_id)
    merges = [
        _split_merge(merge, gguf_path) for merge in _require(metadata, "tokenizer.ggml.merges", gguf_path)
    ]

    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=rule.ignore_merges))
    if rule.nfc:
        tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = _pre_tokenizer(rule)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)

    specials = [
        AddedToken(token, special=True, normalized=False)
        for token, kind_id in zip(tokens, token_types)
        if kind_id == _CONTROL and token
    ]
    user_defined = [
        AddedToken(token, special=False, normalized=False)
        for token, kind_id in zip(tokens, token_types)
        if kind_id == _USER_DEFINED and token
    ]
    # Tokens already in the vocabulary keep their ids, so the vocabulary does not grow.
    tokenizer.add_special_tokens(specials)
    tokenizer.add_tokens(user_defined)
    return tokenizer


def build_tokenizer_config(metadata: dict[str, Any], gguf_path: Path) -> dict[str, Any]:
    """tokenizer_config.json: special token spellings, whether to add BOS, and the chat template."""
    tokens: list[str] = _require(metadata, "tokenizer.ggml.tokens", gguf_path)
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        # llama.cpp adds BOS where the file does not say, for a SentencePiece vocabulary
        "add_bos_token": bool(
            metadata.get("tokenizer.ggml.add_bos_token", metadata.get("tokenizer.ggml.model") == "llama")
        ),
        "add_eos_token": bool(metadata.get("tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
    }
    for name, key in (
        ("bos_token", "tokenizer.ggml.bos_token_id"),
        ("eos_token", "tokenizer.ggml.eos_token_id"),
        ("unk_token", "tokenizer.ggml.unknown_token_id"),
        ("pad_token", "tokenizer.ggml.padding_token_id"),
    ):
        token_id = metadata.get(key)
        if token_id is None:
            continue
        if not 0 <= token_id < len(tokens):
            raise ModelFileError(gguf_path, f"{key} is {token_id}, outside the vocabulary of {len(tokens)}")
        config[name] = tokens[token_id]
    template = metadata.get("tokenizer.chat_template")
    if template:
        config["chat_template"] = template
    return config


def _pre_tokenizer(rule: PreTokenizerRule) -> pre_tokenizers.PreTokenizer:
    if rule.split_regex is not None:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(rule.split_regex), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if rule.isolate_digits:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    return byte_level


def _split_merge(merge: str, gguf_path: Path) -> tuple[str, str]:
    # Byte-level tokens never contain a space (it is spelled "Ġ"), so a merge has exactly one.
    parts = merge.split(" ")
    if len(parts) != 2:
        raise ModelFileError(gguf_path, f"merge {merge!r} is not two tokens separated by one space")
    return parts[0], parts[1]


def _require(metadata: dict[str, Any], key: str, gguf_path: Path) -> Any:
    if key not in metadata:
        raise ModelFileError(gguf_path, f"metadata key {key!r} is missing")
    return metadata[key]
