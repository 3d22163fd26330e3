"""A GGUF's SentencePiece vocabulary (`tokenizer.ggml.model == "llama"`: Gemma 3's, Phi-3's, Llama 2's)
rebuilt as a Hugging Face BPE tokenizer with byte fallback.

The file holds each piece, its score and its type, not merges: llama.cpp's SPM tokenizer joins, again
and again, the neighbouring pair whose joined text is a piece with the highest score, and spells a
piece left unknown as its bytes (`<0xNN>` pieces). A BPE over the same pieces whose merges are every
pair of pieces that joins into a piece, ranked by the joined piece's score (best first), joins the
same pairs in the same order. Text is first prefixed with a space unless the file says not to
(`tokenizer.ggml.add_space_prefix`, false for Gemma 3), and every space spelled "▁".
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers

from tpserve.ranks.errors import ModelFileError

# llama.cpp's token types (gguf.TokenType)
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6
_BYTE_PIECE = re.compile(r"<0x[0-9A-Fa-f]{2}>")
SPACE = "▁"


def build_spm_tokenizer(metadata: dict[str, Any], gguf_path: Path) -> Tokenizer:
    """The SentencePiece vocabulary as a byte-fallback BPE, its control tokens special."""
    tokens: list[str] = metadata.get("tokenizer.ggml.tokens") or []
    scores: list[float] = metadata.get("tokenizer.ggml.scores") or []
    types: list[int] = metadata.get("tokenizer.ggml.token_type") or [_NORMAL] * len(tokens)
    if not tokens or len(scores) != len(tokens) or len(types) != len(tokens):
        raise ModelFileError(
            gguf_path,
            f"a SentencePiece vocabulary needs as many scores and types as tokens "
            f"({len(tokens)} tokens, {len(scores)} scores, {len(types)} types)",
        )
    vocab: dict[str, int] = {}
    for token_id, token in enumerate(tokens):
        vocab.setdefault(token, token_id)
    if not any(_BYTE_PIECE.fullmatch(token) for token, kind in zip(tokens, types) if kind == _BYTE):
        raise ModelFileError(
            gguf_path, "a SentencePiece vocabulary without <0xNN> byte pieces is not supported"
        )
    unknown_id = metadata.get("tokenizer.ggml.unknown_token_id")
    unknown = tokens[unknown_id] if isinstance(unknown_id, int) and 0 <= unknown_id < len(tokens) else None

    model = models.BPE(
        vocab=vocab, merges=_merges(tokens, scores, types, vocab), unk_token=unknown, fuse_unk=True,
        byte_fallback=True,
    )  # fmt: skip
    tokenizer = Tokenizer(model)
    space_prefix = bool(metadata.get("tokenizer.ggml.add_space_prefix", True))
    steps = [normalizers.Prepend(SPACE)] if space_prefix else []
    tokenizer.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", SPACE)])
    decoding = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    tokenizer.decoder = decoders.Sequence(
        [*decoding, decoders.Strip(" ", 1, 0)] if space_prefix else decoding
    )
    tokenizer.add_special_tokens(
        [
            AddedToken(t, special=True, normalized=False)
            for t, kind in zip(tokens, types)
            if kind == _CONTROL and t
        ]
    )
    tokenizer.add_tokens(
        [
            AddedToken(t, special=False, normalized=False)
            for t, kind in zip(tokens, types)
            if kind == _USER_DEFINED and t
        ]
    )
    return tokenizer


def _merges(
    tokens: list[str], scores: list[float], types: list[int], vocab: dict[str, int]
) -> list[tuple[str, str]]:
    """Every split of a normal piece into two pieces, the joined piece's score best first (ties: the
    shorter left part first, as llama.cpp's leftmost pair would join first)."""
    ranked = []
    for token_id, (token, kind) in enumerate(zip(tokens, types)):
        if kind not in (_NORMAL, _USER_DEFINED) or vocab.get(token) != token_id:
            continue
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                ranked.append((-scores[token_id], token_id, cut, left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]
