"""Structured outputs: a request's Constraint compiled to a grammar, and the per-stream matcher that
masks each draw to the tokens the grammar allows next.

The engine is llguidance (bench/grammar.py says why). A Grammars object is built once per server
from the model's tokenizer; `compile` turns a tpserve.v1 Constraint into a Grammar before the
request is queued (a grammar the engine refuses is INVALID_ARGUMENT, naming the problem), and each
stream that runs it gets its own Matcher on rank 0's scheduling thread: `allowed()` before a draw,
`accept(token)` after each kept token. The mask depends only on the stream's own tokens, so a
constrained reply is the same alone or batched, at tp=1 or tp=2.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import grpc
import llguidance
import llguidance.numpy as llg_numpy
import numpy as np
from llguidance.gbnf_to_lark import gbnf_to_lark

from tpserve.server.validation import RequestRefused

# JSON as a model writes it: one space after ":" and ",", no newlines (a model trained on pretty JSON
# still fits), and no unbounded runs of whitespace a small model could loop in until max_tokens.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
ANY_OBJECT = {"type": "object"}


class GrammarRefused(RequestRefused):
    """The constraint does not compile: INVALID_ARGUMENT with the engine's reason."""

    def __init__(self, message: str):
        super().__init__(grpc.StatusCode.INVALID_ARGUMENT, message)


@dataclass(frozen=True)
class Grammar:
    """A compiled constraint, ready to start matchers from (one per stream that runs it)."""

    text: str  # llguidance's grammar (its JSON form)
    tokenizer: llguidance.LLTokenizer = field(compare=False, repr=False)

    def matcher(self) -> Matcher:
        return Matcher(
            llguidance.LLMatcher(self.tokenizer, self.text, log_level=0), self.tokenizer.vocab_size
        )


class Matcher:
    """One stream's place in its grammar."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int):
        self._matcher = matcher
        self._bitmask = llg_numpy.allocate_token_bitmask(1, vocab_size)  # [1, ceil(vocab / 32)] int32

    def allowed(self) -> np.ndarray:
        """The tokens allowed next as a bitmask: int32 words, token t at bit t % 32 of word t // 32
        (end-of-sequence tokens only where the grammar is complete)."""
        llg_numpy.fill_next_token_bitmask(self._matcher, self._bitmask, 0)
        return self._bitmask[0].copy()

    def accept(self, token_id: int) -> None:
        """Advance past a sampled token; ValueError if the grammar does not allow it (a mask slip)."""
        if not self._matcher.consume_token(token_id):
            raise ValueError(f"token {token_id} breaks the reply's grammar: {self._matcher.get_error()}")


class Grammars:
    """Compiles constraints against one model's tokenizer (read on the first constrained request:
    it takes about a second, which a server that never sees one need not pay)."""

    def __init__(self, tokenizer_json: Callable[[], str], vocab_size: int, eos_ids: Iterable[int]):
        self._tokenizer_json = tokenizer_json
        self._vocab_size = vocab_size
        self._eos_ids = sorted(eos_ids)
        self._lock = threading.Lock()  # requests compile on the front ends' threads
        self._llg_tokenizer: llguidance.LLTokenizer | None = None

    @property
    def _tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._llg_tokenizer is None:
                self._llg_tokenizer = llguidance.LLTokenizer(
                    self._tokenizer_json(), n_vocab=self._vocab_size, eos_token=self._eos_ids
                )
            return self._llg_tokenizer

    def rebuild(self, text: str) -> Grammar:
        """A grammar another process compiled (and checked), for this process's matchers: the front
        process compiles, the engine's scheduling thread runs the matcher on each kept token."""
        return Grammar(text, self._tokenizer)

    def compile(self, constraint) -> Grammar:
        """A tpserve.v1 Constraint -> Grammar; GrammarRefused naming what does not compile."""
        kind = constraint.WhichOneof("kind")
        if kind == "json_schema":
            try:
                schema = json.loads(constraint.json_schema)
            except json.JSONDecodeError as error:
                raise GrammarRefused(f"the JSON schema is not valid JSON: {error}") from None
            text = self._from_schema(schema)
        elif kind == "json_object":
            text = self._from_schema(ANY_OBJECT)
        elif kind == "regex":
            text = llguidance.LLMatcher.grammar_from_regex(constraint.regex)
        elif kind == "choice":
            if not constraint.choice.choices:
                raise GrammarRefused("choice needs at least one string")
            alternatives = " | ".join(json.dumps(choice) for choice in constraint.choice.choices)
            text = llguidance.LLMatcher.grammar_from_lark(f"start: {alternatives}")
        elif kind == "grammar":
            text = llguidance.LLMatcher.grammar_from_lark(_as_lark(constraint.grammar))
        else:
            raise GrammarRefused(
                "the constraint names no kind (json_schema, json_object, regex, choice, grammar)"
            )
        tokenizer = self._tokenizer
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(text, tokenizer)
        if is_error:
            raise GrammarRefused(f"the {kind.replace('_', ' ')} does not compile: {_first_line(messages)}")
        return Grammar(text, tokenizer)

    def _from_schema(self, schema) -> str:
        if not isinstance(schema, (dict, bool)):
            raise GrammarRefused("the JSON schema must be an object")
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
        except ValueError as error:
            raise GrammarRefused(f"the JSON schema does not compile: {error}") from None


def _as_lark(grammar: str) -> str:
    """GBNF (llama.cpp's, and vLLM's xgrammar EBNF: rules written `name ::= ...`) becomes Lark."""
    if "::=" not in grammar:
        return grammar
    try:
        return gbnf_to_lark(grammar)
    except Exception as error:  # the converter raises plain exceptions on text it cannot read
        raise GrammarRefused(f"the grammar does not compile: {error}") from None


def _first_line(messages: list[str]) -> str:
    text = " ".join(messages[0].split()) if messages else ""
    return text[:300] or "unknown error"
