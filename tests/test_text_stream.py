"""Incremental detokenization and stop strings: what a client reads is what the model said, cut at a stop."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from tpserve.server.text_stream import TextStream

PIECES = ["Hel", "lo", " W", "orld", "ab", "ST", "OP", "OX", "o", "!", "", " "]


def piece_decode(ids):
    return "".join(PIECES[i] for i in ids)


def byte_decode(ids):
    return bytes(ids).decode("utf-8", errors="replace")


def ids_of(*pieces):
    return [PIECES.index(p) for p in pieces]


def run(stream, ids):
    """Push every id then finish; returns the released (ids, text) and each push's text."""
    released_ids, texts = [], []
    for token in ids:
        out = stream.push(token)
        released_ids += out.token_ids
        texts.append(out.text)
        if stream.stopped:
            break
    else:
        out = stream.finish()
        released_ids += out.token_ids
        texts.append(out.text)
    return released_ids, "".join(texts), texts


def test_text_is_released_token_by_token_without_stop_strings():
    stream = TextStream(piece_decode)
    assert stream.push(ids_of("Hel")[0]).text == "Hel"
    out = stream.push(ids_of("lo")[0])
    assert (out.token_ids, out.text) == (tuple(ids_of("lo")), "lo")
    assert not stream.finish()


def lone_space_dropping_decode(ids):
    """As a SentencePiece tokenizer decodes: the window's first piece loses its leading space."""
    text = piece_decode(ids)
    return text[1:] if text.startswith(" ") else text


def test_a_token_with_no_text_goes_out_at_once_and_the_next_keeps_its_space():
    # A skipped special token (<|im_end|> with skip_special_tokens) adds nothing to the text: its id
    # is sent with the step that sampled it, not held until visible text follows.
    stream = TextStream(lone_space_dropping_decode)
    assert stream.push(ids_of("Hel")[0]).text == "Hel"
    silent = stream.push(ids_of("")[0])
    assert (silent.token_ids, silent.text) == (tuple(ids_of("")), "")
    out = stream.push(ids_of(" W")[0])
    assert (out.token_ids, out.text) == (tuple(ids_of(" W")), " W")


def test_a_token_with_no_text_waits_behind_text_held_for_a_stop_string():
    stream = TextStream(piece_decode, stop=["STOP"])
    assert stream.push(ids_of("ab")[0]).text == "ab"
    assert not stream.push(ids_of("ST")[0]), "ST may begin STOP"
    assert not stream.push(ids_of("")[0]), "tokens go out in order: the silent one waits behind ST"
    out = stream.push(ids_of("o")[0])
    assert (out.token_ids, out.text) == (tuple(ids_of("ST", "", "o")), "STo")


def test_incomplete_utf8_is_held_until_its_last_byte():
    stream = TextStream(byte_decode)
    first = stream.push(0xC3)
    assert not first, "half a character must not be sent"
    out = stream.push(0xA9)
    assert (out.token_ids, out.text) == ((0xC3, 0xA9), "é")


def test_incomplete_utf8_at_the_end_is_flushed_as_a_replacement_char():
    stream = TextStream(byte_decode)
    assert stream.push(ord("a")).text == "a"
    assert not stream.push(0xE2)
    out = stream.finish()
    assert out.token_ids == (0xE2,) and out.text == "\ufffd"


def test_stop_string_across_token_boundaries_is_never_sent():
    ids = ids_of("Hel", "lo", " W", "orld")
    released_ids, text, texts = run(TextStream(piece_decode, stop=["o W"]), ids)
    assert text == "Hell"
    assert texts == ["Hel", "l", ""], "the 'o' that starts the stop string was held back"
    # "lo" straddles the stop's start, so it is released (cut); " W" and "orld" never are.
    assert released_ids == ids_of("Hel", "lo")


def test_held_back_prefix_is_released_when_it_stops_matching():
    stream = TextStream(piece_decode, stop=["STOP"])
    assert stream.push(ids_of("ab")[0]).text == "ab"
    held = stream.push(ids_of("ST")[0])
    assert held.text == "" and held.token_ids == ()
    out = stream.push(ids_of("OX")[0])
    assert out.text == "STOX" and out.token_ids == tuple(ids_of("ST", "OX"))
    assert not stream.stopped


def test_held_back_prefix_is_released_when_the_reply_ends():
    stream = TextStream(piece_decode, stop=["STOP"])
    stream.push(ids_of("ab")[0])
    stream.push(ids_of("ST")[0])
    out = stream.finish()
    assert out.text == "ST" and out.token_ids == tuple(ids_of("ST"))


def test_the_earliest_of_several_stop_strings_wins():
    ids = ids_of("ab", "ST", "OP")
    _, text, _ = run(TextStream(piece_decode, stop=["TO", "bS"]), ids)
    assert text == "a"


def test_prompt_context_keeps_the_first_tokens_leading_space():
    # Like SentencePiece: a decode drops the leading space of its first piece.
    def spm_decode(ids):
        return piece_decode(ids).lstrip(" ")

    context = ids_of("Hel", "lo")
    with_context = TextStream(spm_decode, context_ids=context)
    assert with_context.push(ids_of(" W")[0]).text == " W"
    alone = TextStream(spm_decode)
    assert alone.push(ids_of(" W")[0]).text == "W"


def test_tokens_that_decode_to_nothing_are_still_released():
    ids = ids_of("ab", "", "o")
    released_ids, text, _ = run(TextStream(piece_decode), ids)
    assert released_ids == ids and text == "abo"


def reference_reply(ids, stop):
    """What a client must read: the decode cut at the first stop string to appear, token by token."""
    for num_tokens in range(1, len(ids) + 1):
        text = piece_decode(ids[:num_tokens])
        found = [i for i in (text.find(s) for s in stop) if i >= 0]
        if found:
            return text[: min(found)], True
    return piece_decode(ids), False


@settings(max_examples=300, deadline=None)
@given(
    ids=st.lists(st.integers(0, len(PIECES) - 1), max_size=12),
    stop=st.lists(st.text(alphabet="HeloWrdabSTOPX! ", min_size=1, max_size=4), max_size=3),
)
def test_released_text_matches_a_reference_for_any_tokens_and_stops(ids, stop):
    stream = TextStream(piece_decode, stop=stop)
    released_ids, text, texts = run(stream, ids)
    expected_text, stopped = reference_reply(ids, stop)
    assert text == expected_text
    assert stream.stopped == stopped
    assert released_ids == ids[: len(released_ids)]
    if not stopped:
        assert released_ids == ids
