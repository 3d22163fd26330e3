"""A GGUF's SentencePiece vocabulary (Gemma 3's, Phi-3's) rebuilt: pieces joined best score first,
unknown characters spelled in bytes, the space prefix where the file asks for it."""

from __future__ import annotations

from pathlib import Path

import pytest

from tpserve.gguf_tokenizer import build_tokenizer, build_tokenizer_config
from tpserve.ranks.errors import ModelFileError

# llama.cpp's token types: 1 normal, 2 unknown, 3 control, 6 byte
SPECIALS = [("<unk>", 0.0, 2), ("<s>", 0.0, 3), ("</s>", 0.0, 3)]
BYTES = [(f"<0x{b:02X}>", 0.0, 6) for b in range(256)]
PIECES = ["▁", "a", "b", "c", "d", "e", "h", "l", "o", "r", "w", "x"]
PIECES += ["he", "ll", "▁h", "llo", "▁he", "▁hello", "▁w", "or", "▁wor", "ld", "▁world", "ab", "bc", "xa"]
# a piece's score: later pieces lower, but bc above ab (so "abc" joins b and c first)
SCORES = {piece: -float(rank) for rank, piece in enumerate(PIECES)} | {"bc": -11.5}


def metadata(**extra) -> dict:
    vocab = SPECIALS + BYTES + [(piece, SCORES[piece], 1) for piece in PIECES]
    return {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": [t for t, _, _ in vocab],
        "tokenizer.ggml.scores": [s for _, s, _ in vocab],
        "tokenizer.ggml.token_type": [k for _, _, k in vocab],
        "tokenizer.ggml.unknown_token_id": 0,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
    } | extra


def pieces(tokenizer, text: str) -> list[str]:
    return tokenizer.encode(text, add_special_tokens=False).tokens


def test_pieces_join_best_score_first_and_unknown_characters_fall_back_to_bytes():
    tokenizer = build_tokenizer(metadata(), Path("spm.gguf"))
    assert pieces(tokenizer, "hello world") == ["▁hello", "▁world"]
    assert pieces(tokenizer, "xabc") == ["▁", "xa", "bc"]  # b and c join first, then x and a
    assert pieces(tokenizer, "abc") == ["▁", "a", "bc"]  # bc outscores ab
    assert pieces(tokenizer, "he 日") == ["▁he", "▁", "<0xE6>", "<0x97>", "<0xA5>"]
    ids = tokenizer.encode("hello 日 world</s>", add_special_tokens=False).ids
    assert ids[-1] == 2  # a control token is matched whole
    assert tokenizer.decode(ids, skip_special_tokens=True) == "hello 日 world"


def test_no_space_prefix_where_the_file_says_so_and_bos_added_by_default(tmp_path):
    tokenizer = build_tokenizer(metadata(**{"tokenizer.ggml.add_space_prefix": False}), Path("spm.gguf"))
    assert pieces(tokenizer, "hello world") == ["he", "llo", "▁world"]
    assert tokenizer.decode(tokenizer.encode("hello world").ids) == "hello world"
    config = build_tokenizer_config(metadata(), Path("spm.gguf"))
    assert config["add_bos_token"] is True and config["bos_token"] == "<s>"


def test_a_vocabulary_without_scores_is_refused():
    broken = metadata(**{"tokenizer.ggml.scores": []})
    with pytest.raises(ModelFileError, match="as many scores and types as tokens"):
        build_tokenizer(broken, Path("spm.gguf"))
