"""How many bytes of prompt text the context could ever hold, so a larger prompt is refused before
the tokenizer runs (a 4 MiB prompt holds rank 0's interpreter for seconds while it is tokenized).

No token stands for more input bytes than the longest token of the vocabulary spells, so a text of
B bytes makes at least B / longest tokens, and one over `context x longest` bytes can never fit: a
prompt that could fit is never refused here. A token is measured in the alphabet the tokenizer
works in, which never spells a byte of input in fewer bytes: byte-level BPE writes one character
per byte (counted as one), SentencePiece's "▁" (3 bytes) stands for a space (1), a byte-fallback
token "<0x41>" for one byte. A normalizer can shrink the text before that (NFC composes, lowercase
maps the Kelvin sign's 3 bytes to "k"): those multiply the bound by at most SHRINK; one that can
drop text outright (strip, clean-up, a regex replace) leaves no bound at all, and prompts are then only
checked after tokenizing.
"""

from __future__ import annotations

import json
import logging

from tokenizers import Tokenizer as BackendTokenizer

log = logging.getLogger(__name__)

# Normalizers that keep every character in some form, and how far they can shrink a text in bytes
# (Unicode composition folds up to three code points into one; case mapping one 3-byte character
# into one byte).
SHRINKING = {"NFC": 3, "NFD": 1, "NFKC": 3, "NFKD": 3, "Lowercase": 3, "Prepend": 1}
BYTE_LEVEL = "ByteLevel"


def longest_token_bytes(backend: BackendTokenizer) -> int | None:
    """The most input bytes one token can stand for (a bound, never less than the truth), or None
    when the tokenizer's normalizer can drop text, so no such bound holds."""
    spec = json.loads(backend.to_str())
    shrink = _shrink_factor(spec.get("normalizer"))
    if shrink is None:
        log.warning("the tokenizer's normalizer can drop text: prompts are sized only after tokenizing")
        return None
    byte_level = _has_type(spec.get("pre_tokenizer"), BYTE_LEVEL) or _has_type(
        spec.get("decoder"), BYTE_LEVEL
    )
    added = {token.content for token in backend.get_added_tokens_decoder().values()}
    longest = 1
    for token in backend.get_vocab(with_added_tokens=True):
        # Byte-level BPE spells each input byte as one character of its alphabet (some of them two
        # bytes in UTF-8); added tokens are matched as the text they are.
        size = (
            len(token) if byte_level and token not in added else len(token.encode("utf-8", "surrogatepass"))
        )
        longest = max(longest, size)
    return longest * shrink


def max_prompt_bytes(context_size: int, token_bytes: int | None) -> int | None:
    """The most UTF-8 bytes of prompt text that could fit `context_size` tokens (None: no bound)."""
    return None if token_bytes is None else context_size * token_bytes


def _shrink_factor(normalizer: dict | None) -> int | None:
    if normalizer is None:
        return 1
    kind = normalizer.get("type")
    if kind == "Sequence":
        factor = 1
        for inner in normalizer.get("normalizers", []):
            inner_factor = _shrink_factor(inner)
            if inner_factor is None:
                return None
            factor *= inner_factor
        return factor
    if kind == "Replace":
        # A fixed string replaced by a non-empty one shrinks by at most their ratio of lengths
        # (SentencePiece's conversions replace " " by "▁"); a regex may match anything.
        pattern = normalizer.get("pattern", {}).get("String")
        content = normalizer.get("content", "").encode("utf-8")
        if pattern is None or not content:
            return None
        return max(1, -(-len(pattern.encode("utf-8")) // len(content)))
    return SHRINKING.get(kind)


def _has_type(component: dict | None, kind: str) -> bool:
    if not component:
        return False
    if component.get("type") == kind:
        return True
    inner = component.get("pretokenizers") or component.get("decoders") or []
    return any(_has_type(item, kind) for item in inner)
