"""The tokenizer and chat template rank 0 uses, on a tiny byte-level BPE model directory built here."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from tpserve.ranks.errors import ModelFileError
from tpserve.server.tokenizer import GIL_FREE_CHARS, ChatTemplateError, Tokenizer

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "hello world, hello tokenizer; the end of the line",
    "café naïve 日本語 emoji 😀 numbers 12345",
    "def f(x):\n    return x * 2\n",
] * 20


def build_backend() -> BackendTokenizer:
    backend = BackendTokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    backend.train_from_iterator(CORPUS, trainer)
    return backend


def write_model_dir(
    path: Path,
    *,
    tokenizer_config: dict | None = None,
    generation_config: dict | None = None,
    config: dict | None = None,
) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    build_backend().save(str(path / "tokenizer.json"))
    base_config = {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "chat_template": CHATML}
    (path / "tokenizer_config.json").write_text(json.dumps(base_config | (tokenizer_config or {})))
    if generation_config is not None:
        (path / "generation_config.json").write_text(json.dumps(generation_config))
    (path / "config.json").write_text(json.dumps(config or {"bos_token_id": 1, "eos_token_id": 2}))
    return path


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    return write_model_dir(tmp_path / "model", generation_config={"eos_token_id": [2, 0]})


def test_encode_decode_round_trip(model_dir: Path):
    tokenizer = Tokenizer.from_model_dir(model_dir)
    texts = ["the lazy dog", " leading space", "naïve café 日本語 😀", "tabs\tand\nnewlines\n\n", "x = 12345"]
    for text in texts:
        ids = tokenizer.encode(text)
        assert all(0 <= token_id < tokenizer.vocab_size for token_id in ids)
        assert tokenizer.decode(ids) == text
    # Trained merges make common words single tokens, so this is BPE, not one id per byte.
    assert len(tokenizer.encode("the quick brown fox")) < len("the quick brown fox")


def test_bos_added_only_when_the_model_asks(tmp_path: Path):
    without = Tokenizer.from_model_dir(
        write_model_dir(tmp_path / "a", tokenizer_config={"add_bos_token": False})
    )
    with_bos = Tokenizer.from_model_dir(
        write_model_dir(tmp_path / "b", tokenizer_config={"add_bos_token": True})
    )
    assert with_bos.bos_id == 1
    assert with_bos.encode("hello") == [1, *without.encode("hello")]
    assert without.encode("hello")[0] != 1
    # A rendered chat already spells its own markers, so no second BOS is put in front.
    assert with_bos.encode_chat([{"role": "user", "content": "hi"}])[0] == 1
    assert with_bos.encode_chat([{"role": "user", "content": "hi"}])[1] != 1


def test_eos_ids_union_of_generation_config_list_and_eos_token(model_dir: Path):
    tokenizer = Tokenizer.from_model_dir(model_dir)
    assert tokenizer.eos_ids == frozenset({0, 2})


def test_eos_ids_fall_back_to_config_json(tmp_path: Path):
    model_dir = write_model_dir(
        tmp_path / "model", tokenizer_config={"eos_token": None}, config={"eos_token_id": [0, 1]}
    )
    assert Tokenizer.from_model_dir(model_dir).eos_ids == frozenset({0, 1})


def test_chat_template_renders_chatml_and_special_tokens_stay_whole(model_dir: Path):
    tokenizer = Tokenizer.from_model_dir(model_dir)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello world"}]
    text = tokenizer.render_chat(messages)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhello world<|im_end|>\n<|im_start|>assistant\n"
    )
    assert tokenizer.render_chat(messages, add_generation_prompt=False).endswith("hello world<|im_end|>\n")
    ids = tokenizer.encode_chat(messages)
    assert ids.count(1) == 3  # <|im_start|> is one token each time, never split into pieces
    assert ids.count(2) == 2
    # Decoding leaves the markers out, so streamed text shows only what was said.
    assert tokenizer.decode(ids) == "system\nBe brief.\nuser\nhello world\nassistant\n"


def test_template_helpers_transformers_templates_use(tmp_path: Path):
    template = (
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first message must be from the user') }}"
        "{% endif %}{{ bos_token }}{{ messages | tojson }}|{{ strftime_now('%Y') | length }}"
        "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}"
        "{% generation %}[{{ m['content'] }}]{% endgeneration %}{% endfor %}"
    )
    model_dir = write_model_dir(tmp_path / "model", tokenizer_config={"chat_template": template})
    tokenizer = Tokenizer.from_model_dir(model_dir)
    messages = [{"role": "user", "content": "<b>é</b>"}, {"role": "assistant", "content": "x"}]
    assert tokenizer.render_chat(messages) == (
        '<|im_start|>[{"role": "user", "content": "<b>é</b>"}, {"role": "assistant", "content": "x"}]|4[<b>é</b>]'
    )
    with pytest.raises(ChatTemplateError, match="first message must be from the user"):
        tokenizer.render_chat([{"role": "assistant", "content": "hi"}])


@pytest.mark.parametrize(
    "template",
    [
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{{ messages.__class__.__base__.__subclasses__() }}",
        "{% set _ = messages.append({'role': 'user', 'content': 'injected'}) %}{{ messages | length }}",
        "{{ messages[0].update({'role': 'system'}) }}",
    ],
)
def test_sandbox_refuses_unsafe_templates(tmp_path: Path, template: str):
    model_dir = write_model_dir(tmp_path / "model", tokenizer_config={"chat_template": template})
    tokenizer = Tokenizer.from_model_dir(model_dir)
    with pytest.raises(ChatTemplateError):
        tokenizer.render_chat([{"role": "user", "content": "hi"}])


def test_chat_template_file_beside_config_wins(model_dir: Path):
    (model_dir / "chat_template.jinja").write_text("{% for m in messages %}<{{ m['content'] }}>{% endfor %}")
    assert Tokenizer.from_model_dir(model_dir).render_chat([{"role": "user", "content": "a"}]) == "<a>"


def test_model_without_chat_template(tmp_path: Path):
    model_dir = write_model_dir(tmp_path / "model", tokenizer_config={"chat_template": None})
    tokenizer = Tokenizer.from_model_dir(model_dir)
    with pytest.raises(ChatTemplateError, match="no chat template"):
        tokenizer.render_chat([{"role": "user", "content": "hi"}])


def test_broken_chat_template_is_a_model_file_error(tmp_path: Path):
    model_dir = write_model_dir(
        tmp_path / "model", tokenizer_config={"chat_template": "{% for m in messages %}"}
    )
    with pytest.raises(ModelFileError, match="chat template does not parse"):
        Tokenizer.from_model_dir(model_dir)


@pytest.mark.parametrize("missing", ["tokenizer.json", "tokenizer_config.json"])
def test_missing_file_error_names_the_file(model_dir: Path, missing: str):
    (model_dir / missing).unlink()
    with pytest.raises(ModelFileError) as caught:
        Tokenizer.from_model_dir(model_dir)
    assert caught.value.path == str(model_dir / missing)
    assert str(model_dir / missing) in str(caught.value)


def test_malformed_files_are_model_file_errors(model_dir: Path):
    (model_dir / "generation_config.json").write_text("{not json")
    with pytest.raises(ModelFileError, match="generation_config.json: not valid JSON"):
        Tokenizer.from_model_dir(model_dir)
    (model_dir / "generation_config.json").unlink()
    (model_dir / "tokenizer.json").write_text('{"model": 3}')
    with pytest.raises(ModelFileError, match="tokenizer.json: cannot be loaded"):
        Tokenizer.from_model_dir(model_dir)


def test_a_long_text_is_tokenized_the_same_without_holding_the_interpreter(model_dir: Path):
    """A long prompt's ids are the short path's ids, and other threads (the engine loop, the wire,
    the heartbeat) keep running while it is tokenized."""
    tokenizer = Tokenizer.from_model_dir(model_dir)
    text = "the quick brown fox 1234567890 " * (GIL_FREE_CHARS // 8)
    assert tokenizer.encode(text) == tokenizer._backend.encode(text, add_special_tokens=False).ids
    long_text = text * 20
    tick_times: list[float] = []
    done = threading.Event()

    def tick():
        while not done.is_set():
            tick_times.append(time.monotonic())
            time.sleep(0.0005)

    ticker = threading.Thread(target=tick)
    ticker.start()
    started = time.monotonic()
    tokenizer.encode(long_text)
    ended = time.monotonic()
    done.set()
    ticker.join(timeout=30)
    # With the GIL held for the whole call, the ticker could run only as the call begins or ends.
    assert sum(started < at < ended for at in tick_times) >= 10
