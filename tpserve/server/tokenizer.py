"""The model's tokenizer and chat template, as rank 0 uses them to turn requests into token ids.

Loaded from a Hugging Face model directory: tokenizer.json (run by the `tokenizers` library),
tokenizer_config.json (special tokens, add_bos_token, chat template), generation_config.json and
config.json (end-of-sequence ids). Chat templates are untrusted code from the model's authors, so they
run in jinja2's immutable sandbox, set up the way transformers sets it up so that templates written for
transformers render the same here.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as BackendTokenizer

from tpserve.ranks.errors import ModelFileError, UserError
from tpserve.server.prompt_size import longest_token_bytes

# The tokenizers library's encode holds the GIL for the whole call (seconds for a long prompt: 600
# KB of digits took 4-12 s here), which stalls every stream, the wire and the heartbeat in this
# process; encode_batch gives the ids without holding it. Short texts keep the cheaper call.
GIL_FREE_CHARS = 16384


class ChatTemplateError(UserError):
    """The chat template refused the messages (its own raise_exception) or broke the sandbox rules."""


class Tokenizer:
    """Text <-> token ids for one model, plus its chat template."""

    def __init__(
        self,
        backend: BackendTokenizer,
        *,
        eos_ids: Iterable[int],
        bos_id: int | None = None,
        add_bos: bool = False,
        chat_template: str | None = None,
        special_tokens: dict[str, str] | None = None,
        source: str = "<tokenizer>",
    ):
        self._backend = backend
        # The most input bytes one token stands for (None: no bound), which sizes prompts before
        # they are tokenized (tpserve/server/prompt_size.py).
        self.longest_token_bytes = longest_token_bytes(backend)
        self.eos_ids = frozenset(eos_ids)
        self.bos_id = bos_id
        self.add_bos = add_bos
        # bos_token, eos_token, ...: templates write them into the text themselves.
        self._special_tokens = dict(special_tokens or {})
        self._template = None
        self._template_source = chat_template or ""
        if chat_template:
            try:
                self._template = _template_environment().from_string(chat_template)
            except jinja2.TemplateSyntaxError as error:
                raise ModelFileError(source, f"chat template does not parse: {error}") from error

    @classmethod
    def from_model_dir(cls, path: str | Path, chat_template: str | Path | None = None) -> Tokenizer:
        """`chat_template`: a Jinja file used instead of the checkpoint's template (--chat-template)."""
        model_dir = Path(path)
        tokenizer_file = model_dir / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise ModelFileError(tokenizer_file, "no such file")
        try:
            backend = BackendTokenizer.from_file(str(tokenizer_file))
        except Exception as error:  # the tokenizers library raises plain Exception on bad files
            raise ModelFileError(tokenizer_file, f"cannot be loaded: {error}") from error
        tokenizer_config = _read_json(model_dir / "tokenizer_config.json", required=True)
        generation_config = _read_json(model_dir / "generation_config.json", required=False)
        model_config = _read_json(model_dir / "config.json", required=False)

        special_tokens = {
            name: _token_text(tokenizer_config[name])
            for name in ("bos_token", "eos_token", "unk_token", "pad_token")
            if tokenizer_config.get(name)
        }
        bos_id = _token_id(backend, special_tokens.get("bos_token"))
        if bos_id is None:
            bos_id = _first_id(model_config.get("bos_token_id"))
        eos_value = generation_config.get("eos_token_id")
        if eos_value is None:
            eos_value = model_config.get("eos_token_id")
        eos_ids = set(_ids(eos_value))
        eos_token_id = _token_id(backend, special_tokens.get("eos_token"))
        if eos_token_id is not None:
            eos_ids.add(eos_token_id)
        if not eos_ids:
            raise ModelFileError(
                model_dir, "no end-of-sequence token in generation_config, config or tokenizer_config"
            )

        add_bos = tokenizer_config.get("add_bos_token")
        if add_bos is None:
            # No explicit flag (Llama 3 style): the tokenizer.json's post-processor decides.
            probe = backend.encode("a", add_special_tokens=True).ids
            add_bos = bos_id is not None and bool(probe) and probe[0] == bos_id
        return cls(
            backend,
            eos_ids=eos_ids,
            bos_id=bos_id,
            add_bos=bool(add_bos) and bos_id is not None,
            chat_template=(
                _template_file(chat_template)
                if chat_template
                else _chat_template(model_dir, tokenizer_config)
            ),
            special_tokens=special_tokens,
            source=str(model_dir),
        )

    @property
    def vocab_size(self) -> int:
        return self._backend.get_vocab_size(with_added_tokens=True)

    def backend_json(self) -> str:
        """The tokenizer as tokenizer.json has it (what the grammar engine reads)."""
        return self._backend.to_str()

    def encode(self, text: str, *, add_bos: bool | None = None) -> list[int]:
        """Token ids of `text`; BOS first when the model wants it (add_bos=None) or when asked.

        Special tokens spelled in the text (such as <|im_start|>) become their ids, which is how a
        rendered chat template is meant to be read.
        """
        if len(text) < GIL_FREE_CHARS:
            ids = self._backend.encode(text, add_special_tokens=False).ids
        else:  # the same ids, without holding the interpreter (see GIL_FREE_CHARS)
            ids = self._backend.encode_batch([text], add_special_tokens=False)[0].ids
        wants_bos = self.add_bos if add_bos is None else add_bos
        if wants_bos and self.bos_id is not None and (not ids or ids[0] != self.bos_id):
            ids.insert(0, self.bos_id)
        return ids

    def encode_chat(
        self,
        messages: Sequence[dict[str, Any]],
        add_generation_prompt: bool = True,
        *,
        tools: list[dict] | None = None,
        template_kwargs: dict[str, Any] | None = None,
        continue_final_message: bool = False,
        add_bos: bool = False,
    ) -> list[int]:
        """Token ids of the rendered conversation. No BOS is added (templates write their own)
        unless add_bos (vLLM's add_special_tokens), and then only where the model adds one."""
        text = self.render_chat(
            messages,
            add_generation_prompt,
            tools=tools,
            template_kwargs=template_kwargs,
            continue_final_message=continue_final_message,
        )
        return self.encode(text, add_bos=None if add_bos else False)

    def token_text(self, token_id: int) -> str:
        """The text of one token id (such as a vision model's image token), as the vocabulary has it."""
        return self._backend.id_to_token(token_id) or f"<token {token_id}>"

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids` with special tokens (BOS, EOS, role markers) left out, unless
        skip_special_tokens is false.

        A prefix that ends inside a multi-byte character decodes with U+FFFD at the end: text
        streamed in pieces must hold such a tail back until the character completes.
        """
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    @property
    def special_tokens(self) -> dict[str, str]:
        """bos_token, eos_token, unk_token and pad_token as tokenizer_config.json names them (those set)."""
        return dict(self._special_tokens)

    @property
    def chat_template(self) -> str:
        """The chat template's source ("" without one): which tool-call and reasoning formats the
        model writes is read from it."""
        return self._template_source

    def render_chat(
        self,
        messages: Sequence[dict[str, Any]],
        add_generation_prompt: bool = True,
        *,
        tools: list[dict] | None = None,
        template_kwargs: dict[str, Any] | None = None,
        continue_final_message: bool = False,
    ) -> str:
        """The conversation as the prompt text the model was trained on. `tools` and the extra
        `template_kwargs` (enable_thinking, ...) reach the template as transformers passes them;
        continue_final_message leaves the last message open (its end-of-turn marker cut off)."""
        if self._template is None:
            raise ChatTemplateError("this model has no chat template; send a plain prompt instead")
        try:
            text = self._template.render(
                **(template_kwargs or {}),
                messages=[dict(message) for message in messages],
                tools=tools,
                add_generation_prompt=add_generation_prompt,
                **self._special_tokens,
            )
        except jinja2.TemplateError as error:
            raise ChatTemplateError(f"chat template refused the messages: {error}") from error
        return _left_open(text, messages[-1]) if continue_final_message else text


def _left_open(text: str, final: dict[str, Any]) -> str:
    """The rendered chat cut right after the final message's text, so a reply continues it (what
    the template closes the turn with goes), as transformers' continue_final_message cuts it."""
    content = final.get("content") or ""
    if isinstance(content, list):
        content = "".join(part.get("text", "") for part in content if isinstance(part, dict))
    for piece in (content, content.strip()):
        if piece and piece in text:
            return text[: text.rindex(piece) + len(piece)]
    raise ChatTemplateError("continue_final_message: the template does not write the final message's text")


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; serving
    just renders what is inside."""

    tags = {"generation"}

    def parse(self, parser: Any) -> list[Any]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _template_environment() -> ImmutableSandboxedEnvironment:
    # Same settings and helpers as transformers' apply_chat_template.
    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationBlock, jinja2.ext.loopcontrols],
    )
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = _strftime_now
    return environment


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys=False
):
    # jinja's own tojson escapes HTML characters, which would change the prompt text.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _chat_template(model_dir: Path, tokenizer_config: dict[str, Any]) -> str | None:
    # Newer transformers save the template beside the config rather than inside it.
    template_file = model_dir / "chat_template.jinja"
    if template_file.is_file():
        return template_file.read_text(encoding="utf-8")
    template = tokenizer_config.get("chat_template")
    processor_file = model_dir / "chat_template.json"  # a multimodal processor's (llava-hf)
    if template is None and processor_file.is_file():
        template = _read_json(processor_file, required=True).get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {item.get("name"): item.get("template") for item in template if isinstance(item, dict)}
        template = named.get("default")
    if template is not None and not isinstance(template, str):
        raise ModelFileError(model_dir / "tokenizer_config.json", "chat_template is neither text nor a list")
    return template


def _read_json(path: Path, *, required: bool) -> dict[str, Any]:
    if not path.is_file():
        if required:
            raise ModelFileError(path, "no such file")
        return {}
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ModelFileError(path, f"not valid JSON: {error}") from error
    if not isinstance(value, dict):
        raise ModelFileError(path, "is not a JSON object")
    return value


def _token_text(value: Any) -> str:
    # Older tokenizer_config files spell special tokens as {"content": "<s>", ...}.
    return value["content"] if isinstance(value, dict) else str(value)


def _token_id(backend: BackendTokenizer, text: str | None) -> int | None:
    return None if text is None else backend.token_to_id(text)


def _ids(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(item) for item in value] if isinstance(value, list) else [int(value)]


def _first_id(value: Any) -> int | None:
    ids = _ids(value)
    return ids[0] if ids else None


def _template_file(path: str | Path) -> str:
    try:
        return Path(path).read_text()
    except OSError as error:
        raise ModelFileError(path, f"the chat template cannot be read: {error.strerror or error}") from None
