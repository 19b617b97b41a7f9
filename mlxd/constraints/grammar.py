"""Compiling request features (``response_format``, a forced ``tool_choice``) to llguidance grammars.

One :class:`GrammarCompiler` per served model; each compile returns a :class:`CompiledGrammar` whose matcher, in
its initial state, the logits processors of :mod:`mlxd.constraints.processor` copy for each row.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import llguidance
import llguidance.hf
from llguidance import LLMatcher, LLParserLimits, LLTokenizer
from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask
from mlx_lm.tokenizer_utils import TokenizerWrapper

from mlxd.constraints.schema import ANY_JSON_OBJECT, close_objects, find_ref_cycle, with_json_options
from mlxd.constraints.tools import select_tools, tool_call_lark, tool_index
from mlxd.errors import RequestError

# Short errors: verbose ones carry the whole grammar and parser state, which a client's 400 body does not need.
LIMITS = LLParserLimits(verbose_errors=False)
_MAX_ERROR_CHARS = 600
# Compiled grammars kept for reuse: clients tend to send the same schema or tools with every request.
_CACHE_SIZE = 64
SCHEMA_PARAM = "response_format.json_schema.schema"


@dataclass(frozen=True, slots=True, eq=False)
class CompiledGrammar:
    """A grammar ready to constrain rows: ``grammar`` is llguidance's grammar text, ``matcher`` its matcher in the
    initial state (never advanced: processors take copies), ``feature`` what it was compiled from."""

    grammar: str
    matcher: LLMatcher
    feature: str


class GrammarCompiler:
    """Compiles grammars for one model's tokenizer. Thread-safe; the llguidance tokenizer is built on first use.

    ``tokenizer`` is mlx-lm's ``TokenizerWrapper`` (or a fast Hugging Face tokenizer). ``n_vocab`` is the width of
    the model's logits, which may exceed the tokenizer's vocabulary (padded embeddings); it defaults to the
    tokenizer's size. Ids at or above :attr:`vocab_size` are never allowed.
    """

    def __init__(self, tokenizer: Any, n_vocab: int | None = None) -> None:
        self._hf = tokenizer._tokenizer if isinstance(tokenizer, TokenizerWrapper) else tokenizer
        self.vocab_size: int = len(self._hf)
        self.n_vocab: int = n_vocab or self.vocab_size
        self._lock = threading.Lock()
        self._llg: LLTokenizer | None = None
        self._cache: OrderedDict[str, CompiledGrammar] = OrderedDict()
        self._cache_lock = threading.Lock()

    def llg_tokenizer(self) -> LLTokenizer:
        """The llguidance tokenizer (built once, ~10 ms to 1 s by vocabulary size). Its vocabulary is at least
        :attr:`n_vocab` ids. ``RequestError`` when the tokenizer is not one llguidance can read."""
        if self._llg is None:
            with self._lock:
                if self._llg is None:
                    self._llg = self._build_llg_tokenizer()
        return self._llg

    def json_object(self) -> CompiledGrammar:
        """Any JSON object (``response_format: {"type": "json_object"}``)."""
        schema = with_json_options(ANY_JSON_OBJECT, param="response_format")
        return self._cached(["json_object"], lambda: self.compile(
            LLMatcher.grammar_from_json_schema(schema), feature="json_object", param="response_format"))

    def json_schema(self, schema: dict[str, Any], strict: bool = False) -> CompiledGrammar:
        """JSON that validates against ``schema``. With ``strict`` (OpenAI's strict mode) objects that do not set
        ``additionalProperties`` are closed. A keyword llguidance cannot enforce (``not``, ``if``/``then``,
        ``uniqueItems``, ``oneOf``, an unknown ``format``, a remote ``$ref``, a look-around in a ``pattern``, ...)
        and a schema with no finite instance (a ``$ref`` loop) are a ``RequestError`` naming the field
        (:data:`SCHEMA_PARAM`) whose message names the keyword; nothing is silently ignored."""
        if not isinstance(schema, dict):
            raise RequestError(f"response_format.json_schema.schema must be a JSON object, got {schema!r}"[:200],
                               param=SCHEMA_PARAM)
        return self._cached(["json_schema", schema, bool(strict)], lambda: self._json_schema(schema, strict))

    def _json_schema(self, schema: dict[str, Any], strict: bool) -> CompiledGrammar:
        if (cycle := find_ref_cycle(schema)) is not None:
            raise RequestError(f"response_format json_schema has no finite instance: its $ref chain {cycle[:200]} "
                               f"leads back to itself", param=SCHEMA_PARAM)
        if strict:
            schema = close_objects(schema)
        schema = with_json_options(schema, param=SCHEMA_PARAM)
        try:
            grammar = LLMatcher.grammar_from_json_schema(schema)
        except ValueError as e:
            raise RequestError(f"response_format json_schema is invalid: {_clean(str(e))}", param=SCHEMA_PARAM) from e
        return self.compile(grammar, feature="json_schema", param=SCHEMA_PARAM)

    def tool_call(self, tools: list[dict[str, Any]], choice: str | dict[str, Any] = "required",
                  parallel: bool = False) -> CompiledGrammar:
        """A forced tool call in the Hermes format, then end of sequence (see :mod:`mlxd.constraints.tools`).

        ``choice`` is ``"required"`` (any of ``tools``) or ``{"type": "function", "function": {"name": ...}}``;
        with ``parallel`` one or more calls separated by newlines. ``RequestError`` names a bad tool, choice or
        parameters schema (param ``tools[i]...`` or ``tool_choice``).
        """
        return self._cached(["tool_call", tools, choice, bool(parallel)],
                            lambda: self._tool_call(tools, choice, parallel))

    def _tool_call(self, tools: list[dict[str, Any]], choice: str | dict[str, Any], parallel: bool) -> CompiledGrammar:
        functions = select_tools(tools, choice)
        lark = tool_call_lark(functions, parallel=parallel, marker=self.marker)
        try:
            return self.compile(LLMatcher.grammar_from_lark(lark), feature="tool_call", param="tools")
        except RequestError:
            self._blame_tool(tools, functions)
            raise

    def compile(self, grammar: str, *, feature: str, param: str) -> CompiledGrammar:
        """Compile llguidance grammar text (``LLMatcher.grammar_from_*``) for this tokenizer; a grammar llguidance
        rejects, at once or at its first token, is a ``RequestError(param=param)`` that quotes llguidance's
        reason."""
        matcher = LLMatcher(self.llg_tokenizer(), grammar, log_level=0, limits=LIMITS)
        if not matcher.is_error():  # some grammars fail only when asked for their first tokens
            probe = matcher.deep_copy()
            fill_next_token_bitmask(probe, allocate_token_bitmask(1, self.llg_tokenizer().vocab_size))
            if probe.is_error():
                matcher = probe
        if matcher.is_error():
            raise RequestError(f"{feature} cannot be enforced: {_clean(matcher.get_error())}", param=param)
        return CompiledGrammar(grammar=grammar, matcher=matcher, feature=feature)

    def marker(self, text: str) -> str:
        """The lark expression for markup ``text``: its literal, or also its token when the tokenizer has it as
        one added token (llguidance only matches an added token by id, ``<[id]>``, never by its text)."""
        literal = json.dumps(text)
        token_id = self._hf.convert_tokens_to_ids(text)
        if isinstance(token_id, int) and 0 <= token_id < self.vocab_size \
                and self._hf.convert_ids_to_tokens(token_id) == text \
                and self.llg_tokenizer().is_special_token(token_id):
            return f"<[{token_id}]> | {literal}"
        return literal

    def _cached(self, key: list[Any], build: Callable[[], CompiledGrammar]) -> CompiledGrammar:
        """``build()``, or the grammar an equal request compiled before (key order matters: property order is
        part of a JSON grammar). Failures are not cached."""
        try:
            text = json.dumps(key)
        except (TypeError, ValueError):  # not JSON data: compile it every time
            return build()
        with self._cache_lock:
            if (hit := self._cache.get(text)) is not None:
                self._cache.move_to_end(text)
                return hit
        compiled = build()
        with self._cache_lock:
            self._cache[text] = compiled
            while len(self._cache) > _CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled

    def _build_llg_tokenizer(self) -> LLTokenizer:
        try:
            return llguidance.hf.from_tokenizer(self._hf, n_vocab=max(self.n_vocab, self.vocab_size))
        except (ValueError, TypeError) as e:
            raise RequestError(f"grammar-constrained output is not available for this model's tokenizer "
                               f"({type(self._hf).__name__}): {e}") from e

    def _blame_tool(self, tools: list[dict[str, Any]], functions: dict[str, dict[str, Any]]) -> None:
        """Raise a ``RequestError`` naming the first tool whose parameters schema does not compile alone."""
        for name, parameters in functions.items():
            try:
                error = LLMatcher.validate_grammar(LLMatcher.grammar_from_json_schema(parameters), limits=LIMITS)
            except ValueError as e:
                error = str(e)
            if error:
                raise RequestError(f"tool {name!r}: parameters cannot be enforced: {_clean(error)}",
                                   param=f"tools[{tool_index(tools, name)}].function.parameters")


def _clean(error: str) -> str:
    """llguidance's error text without its debugging trailer, clipped."""
    text = error.replace("<non-verbose/>", "").strip()
    return text if len(text) <= _MAX_ERROR_CHARS else text[:_MAX_ERROR_CHARS] + "..."
