"""Each family's own chat template renders here what transformers' apply_chat_template renders: the
families' tiny checkpoints (tests/tiny_hf_models.py, tests/tiny_models.py) given the template their
real checkpoints ship (tests/golden/chat_templates/, README.md there; gpt-oss's harmony template in
tests/golden/) and the template's special tokens, then the same conversations rendered by tpserve's
Tokenizer and by transformers' tokenizer over the same directory: a system message, several turns
with and without the generation prompt, tools on offer, a tool call and its result, template
variables (Qwen3's enable_thinking, gpt-oss's reasoning_effort). Where transformers' render refuses
(a template's own raise_exception: Gemma's turns without a system role), tpserve refuses too."""

from __future__ import annotations

import json
from pathlib import Path

import jinja2
import pytest
from daemon import running_daemon
from harmony_models import write_harmony_model
from test_http_api import post
from tiny_hf_models import VOCAB, transformers, write_hf_model
from tiny_models import build_tokenizer, write_tiny_model

from tpserve.server.tokenizer import ChatTemplateError, Tokenizer

GOLDEN = Path(__file__).parent / "golden" / "chat_templates"

# template -> (the tiny family it goes with, its special tokens: the vocabulary's added ones first,
# then bos_token and eos_token as the model's tokenizer_config.json names them)
TEMPLATES = {
    "Qwen3-0.6B": (
        "qwen3-moe",  # Qwen3-30B-A3B ships Qwen3's template
        ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>"],
        None,
        "<|im_end|>",
    ),
    "Qwen2.5-7B-Instruct": (
        "qwen2-moe",
        ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>"],
        None,
        "<|im_end|>",
    ),
    "Llama-3.1-8B-Instruct": (
        "llama",
        ["<|begin_of_text|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>", "<|python_tag|>"],
        "<|begin_of_text|>",
        "<|eot_id|>",
    ),
    "Mistral-Nemo-Instruct-2407": (
        "mixtral",
        ["<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]"]
        + ["[TOOL_CALLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]"],
        "<s>",
        "</s>",
    ),
    # Mistral's first instruct models' [INST] turns, no system role (Mixtral-8x7B-Instruct's format)
    "Mistral-7B-Instruct-v0.2": ("mixtral", ["<unk>", "<s>", "</s>", "[INST]", "[/INST]"], "<s>", "</s>"),
    "Phi-3.5-mini-instruct": (
        "phi4-mini",
        ["<unk>", "<s>", "<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"],
        "<s>",
        "<|endoftext|>",
    ),
    # Phi-4 (14B, a Phi3ForCausalLM): ChatML turns with <|im_sep|>
    "phi-4": ("phi3", ["<|endoftext|>", "<|im_start|>", "<|im_sep|>", "<|im_end|>"], None, "<|im_end|>"),
    # Gemma's turns (Gemma 2's template: no system role, user and model alternating)
    "gemma-2-2b-it": (
        "gemma3",
        ["<pad>", "<bos>", "<eos>", "<unk>", "<start_of_turn>", "<end_of_turn>"],
        "<bos>",
        "<eos>",
    ),
    "GLM-4.6": (
        "glm4-moe",
        ["<|endoftext|>", "[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>"]
        + ["<think>", "</think>", "<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>"]
        + ["<arg_value>", "</arg_value>", "<tool_response>", "</tool_response>"],
        None,
        "<|endoftext|>",
    ),
}
DENSE = ("llama",)  # families of tests/tiny_models.py (the rest: tests/tiny_hf_models.py)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city now.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "The city's name."}},
            "required": ["city"],
        },
    },
}
SYSTEM = [
    {"role": "system", "content": "You answer in one word."},
    {"role": "user", "content": "Hello there."},
]
TURNS = [
    *SYSTEM,
    {"role": "assistant", "content": "Hello."},
    {"role": "user", "content": "Name a colour."},
]
# a call's arguments as an object, as tpserve hands them over (tpserve/server/template_inputs.py);
# nine characters of id, as Mistral's template demands
CALL = {
    "id": "call12345",
    "type": "function",
    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
}
TOOL_TURNS = [
    {"role": "user", "content": "What is the weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call12345", "name": "get_weather", "content": "Sunny, 21 C."},
]
# name -> (messages, add_generation_prompt, tools, template variables)
CONVERSATIONS = {
    "system": (SYSTEM, True, None, None),
    "turns": (TURNS, True, None, None),
    "turns-closed": ([*TURNS, {"role": "assistant", "content": "Blue."}], False, None, None),
    "user-turns": (TURNS[1:], True, None, None),
    "user-turns-closed": ([*TURNS[1:], {"role": "assistant", "content": "Blue."}], False, None, None),
    "tools-offered": (SYSTEM, True, [WEATHER], None),
    "tool-call-and-result": (TOOL_TURNS, True, [WEATHER], None),
    "no-thinking": (TURNS, True, None, {"enable_thinking": False}),
    "reasoning-effort": (TURNS, True, [WEATHER], {"reasoning_effort": "high"}),
}


def write_templated_model(out: Path, template: str) -> Path:
    """The tiny checkpoint of `template`'s family, carrying that template and its special tokens."""
    if template == "gpt-oss":
        return write_harmony_model(out)
    family, tokens, bos, eos = TEMPLATES[template]
    model_dir = write_tiny_model(out, family) if family in DENSE else write_hf_model(out, family)
    tokenizer = build_tokenizer(VOCAB, tokens)
    tokenizer.save(str(model_dir / "tokenizer.json"))
    # transformers reads tokenizer.json as it is (a family's own class, Gemma's, would redo its
    # pre-tokenizer), as tpserve does
    config = {"eos_token": eos, "add_bos_token": False, "tokenizer_class": "PreTrainedTokenizerFast"}
    config |= {"bos_token": bos} if bos else {}
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config))
    (model_dir / "chat_template.jinja").write_text((GOLDEN / f"{template}.jinja").read_text())
    return model_dir


@pytest.fixture(scope="module", params=[*TEMPLATES, "gpt-oss"])
def templated(request, tmp_path_factory):
    """(tpserve's Tokenizer, transformers' tokenizer) over one family's checkpoint and template."""
    model_dir = write_templated_model(tmp_path_factory.mktemp("templated") / request.param, request.param)
    return Tokenizer.from_model_dir(model_dir), transformers.AutoTokenizer.from_pretrained(model_dir)


def their_render(tokenizer, messages, add_generation_prompt, tools, variables) -> str | None:
    """transformers' rendered text, None where the template refuses the conversation."""
    try:
        return tokenizer.apply_chat_template(
            json.loads(json.dumps(messages)),  # its own copy: a template may not change ours
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
            **(variables or {}),
        )
    except jinja2.TemplateError:  # the template's raise_exception
        return None


@pytest.mark.parametrize("conversation", sorted(CONVERSATIONS))
def test_the_template_renders_what_transformers_renders(templated, conversation):
    ours, theirs = templated
    messages, add_generation_prompt, tools, variables = CONVERSATIONS[conversation]
    expected = their_render(theirs, messages, add_generation_prompt, tools, variables)
    if expected is None:
        with pytest.raises(ChatTemplateError):
            ours.render_chat(messages, add_generation_prompt, tools=tools, template_kwargs=variables)
        return
    rendered = ours.render_chat(messages, add_generation_prompt, tools=tools, template_kwargs=variables)
    assert rendered == expected
    assert (
        messages[-1 if add_generation_prompt else -2]["content"] in rendered or messages[-1]["role"] == "tool"
    )
    ids = ours.encode_chat(messages, add_generation_prompt, tools=tools, template_kwargs=variables)
    assert ids == theirs.encode(expected, add_special_tokens=False)


def test_every_template_renders_plain_turns(templated):
    # so no template's comparisons above are all refusals
    _, theirs = templated
    assert their_render(theirs, *CONVERSATIONS["user-turns"]) is not None


@pytest.mark.parametrize("template", ["Qwen3-0.6B", "GLM-4.6"])
def test_the_daemon_tokenizes_an_openai_tool_conversation_as_transformers_renders_it(tmp_path, template):
    # What a client sends (a call's arguments as JSON text, null content beside a call) against what
    # transformers renders for the same conversation as vLLM hands it over (arguments an object,
    # content ""; given null or no content, transformers fails in Qwen3's template)
    model_dir = write_templated_model(tmp_path / template, template)
    call = CALL | {"function": CALL["function"] | {"arguments": json.dumps(CALL["function"]["arguments"])}}
    sent = [*SYSTEM, {"role": "assistant", "content": None, "tool_calls": [call]}, *TOOL_TURNS[2:]]
    documented = [*SYSTEM, {"role": "assistant", "content": "", "tool_calls": [CALL]}, *TOOL_TURNS[2:]]
    reference = transformers.AutoTokenizer.from_pretrained(model_dir)
    expected = reference.apply_chat_template(
        documented, tools=[WEATHER], add_generation_prompt=True, tokenize=False
    )
    with running_daemon("spawn", model_dir, tmp_path / "logs", "--context", "1024") as daemon:
        response = post(daemon, "../tokenize", {"messages": sent, "tools": [WEATHER]})
    assert response.status_code == 200, response.text
    assert response.json()["tokens"] == reference.encode(expected, add_special_tokens=False)
