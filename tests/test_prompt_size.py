"""The bound on prompt bytes checked before tokenizing never refuses a prompt that could fit: no text
tokenizes into fewer tokens than its bytes over the longest token, for the tokenizer kinds served
(byte-level BPE, SentencePiece-style with a replace normalizer, NFKC), and a normalizer that can
drop text leaves no bound."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st
from tiny_models import build_tokenizer
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from tpserve.server.prompt_size import longest_token_bytes, max_prompt_bytes

CORPUS = ["the quick brown fox jumps over the lazy dog", "hello world", "ünïcödé 数字 1234567890"] * 20


def sentencepiece_like() -> Tokenizer:
    tokenizer = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tokenizer.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback()])
    alphabet = [f"<0x{byte:02X}>" for byte in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<unk>", *alphabet], show_progress=False)
    tokenizer.train_from_iterator(CORPUS, trainer)
    return tokenizer


def nfkc_byte_level() -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Lowercase()])
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=500, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tokenizer.train_from_iterator(CORPUS, trainer)
    return tokenizer


TOKENIZERS = {
    "byte_level": build_tokenizer(400),
    "sentencepiece": sentencepiece_like(),
    "nfkc": nfkc_byte_level(),
}
TEXT = st.text(st.characters(codec="utf-8"), max_size=300) | st.sampled_from(
    ["a" * 300, "1" * 300, " " * 300, "\n" * 300, "ﬃ" * 100, "K" * 100, "e\u0301" * 100, "<|endoftext|>" * 20]
)


@settings(max_examples=300, deadline=None)
@given(text=TEXT)
def test_no_text_makes_fewer_tokens_than_its_bytes_over_the_longest_token(text):
    for name, tokenizer in TOKENIZERS.items():
        bound = longest_token_bytes(tokenizer)
        num_tokens = len(tokenizer.encode(text, add_special_tokens=False).ids)
        assert num_tokens >= math.ceil(len(text.encode()) / bound), name
        # So a prompt over the bound for a context never fits that context.
        context = max(1, num_tokens)
        assert len(text.encode()) <= max_prompt_bytes(context, bound), name


def test_byte_level_counts_a_character_per_byte_and_added_tokens_as_their_text():
    # 3 specials (the longest "<|endoftext|>", 13 bytes) and 256 one-byte tokens.
    assert longest_token_bytes(build_tokenizer(259)) == 13
    assert max_prompt_bytes(64, 13) == 832


def test_a_normalizer_that_can_drop_text_leaves_no_bound():
    tokenizer = build_tokenizer(300)
    tokenizer.normalizer = normalizers.Strip()
    assert longest_token_bytes(tokenizer) is None
    assert max_prompt_bytes(64, None) is None
    tokenizer.normalizer = normalizers.Sequence([normalizers.NFC(), normalizers.BertNormalizer()])
    assert longest_token_bytes(tokenizer) is None
