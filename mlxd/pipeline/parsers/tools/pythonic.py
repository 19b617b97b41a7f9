"""Pythonic tool calls (Llama 4, Llama 3.2's pythonic template): a Python list of calls ``[f(a=1, b="x"), g()]``,
the whole message or between ``<|python_start|>`` and ``<|python_end|>``. Read with :mod:`ast`: literals only,
nothing is ever evaluated."""

from __future__ import annotations

import ast
import json
import re
from typing import Any

from mlxd.pipeline.parsers.tools.json_call import PYTHON, Scanner
from mlxd.pipeline.parsers.tools.streaming import State, StreamingToolParser, skip_ws

START, END = "<|python_start|>", "<|python_end|>"
_CALL = re.compile(r"\s*([A-Za-z_]\w*)\s*\(")
_CALL_PREFIX = re.compile(r"\s*(?:[A-Za-z_]\w*\s*)?\Z")  # what may still become the start of a call
_NAMES = {"true": True, "false": False, "null": None}


def parse_call(text: str) -> tuple[str, dict[str, Any]] | None:
    """The name and keyword arguments of one call ``f(a=1, b="x")``, its values Python literals (or JSON's
    ``true``/``false``/``null``); None for anything else."""
    try:
        node = ast.parse(text.strip(), mode="eval").body
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
            return None
        args = {kw.arg: _literal(kw.value) for kw in node.keywords if kw.arg is not None}
        if len(args) != len(node.keywords):
            return None  # **kwargs
        json.dumps(args)  # sets, bytes, complex numbers have no JSON form
    except (SyntaxError, ValueError, TypeError, MemoryError, RecursionError):
        return None
    return node.func.id, args


def _literal(node: ast.expr) -> Any:
    if isinstance(node, ast.Name) and node.id in _NAMES:
        return _NAMES[node.id]
    return ast.literal_eval(node)


class PythonicToolParser(StreamingToolParser):
    """A message is calls when it starts (after whitespace) with ``[``, or where ``<|python_start|>`` opens them.
    Each call goes out, name and arguments together, when its closing parenthesis arrives; a list whose first item
    is not a call to a known tool is content.

    At the end of the stream: complete calls are calls; an incomplete one is content (the first call's with the
    list's opening, a later one's from after its comma).
    """

    name = "pythonic"
    special_markers = (START, END)
    openers = (START,)
    closers = {START: END}

    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        super().__init__(tools)
        self._state = self._start
        self._scanner = Scanner(syntax=PYTHON)
        self._call_at = self._scanned = 0

    @classmethod
    def matches(cls, chat_template: str) -> bool:
        return START in chat_template or "[func_name1(" in chat_template

    def _start(self, final: bool) -> bool:
        pos = skip_ws(self._buf, 0)
        if pos == len(self._buf) and not final:
            return False
        if self._buf.startswith("[", pos):
            self._pos, self._raw, self._closer = pos + 1, True, ""
            return self._goto(self._item)
        return self._goto(self._outside)

    def _start_region(self, opener: str) -> State:
        return self._list

    def _list(self, final: bool) -> bool:
        pos = skip_ws(self._buf, self._pos)
        if pos == len(self._buf):
            return False
        if self._buf[pos] != "[":
            return self._reject()
        self._pos = pos + 1
        return self._goto(self._item)

    def _item(self, final: bool) -> bool:
        m = _CALL.match(self._buf, self._pos)
        if m is None:
            return not _CALL_PREFIX.match(self._buf, self._pos) and self._reject()
        if m.group(1) not in self.tools:
            return self._reject()
        self._call_at = skip_ws(self._buf, self._pos)
        self._scanner, self._scanned = Scanner(syntax=PYTHON), m.end() - 1
        return self._goto(self._call)

    def _call(self, final: bool) -> bool:
        end = self._scanner.feed(self._buf, self._scanned)
        if end is None:
            self._scanned = len(self._buf)
            return False
        call = parse_call(self._buf[self._call_at:end])
        if call is None:
            return self._reject()
        self._announce(call[0])
        self._arguments(json.dumps(call[1], ensure_ascii=False))
        self._consume(end)
        return self._goto(self._next)

    def _next(self, final: bool) -> bool:
        """After a call: ``,`` and the next one, or ``]`` and the end of the list (anything else is content)."""
        pos = skip_ws(self._buf, 0)
        if pos == len(self._buf):
            return False
        char = self._buf[pos]
        self._consume(pos + 1 if char in ",]" else pos)
        if char == ",":
            self._raw = True
            return self._goto(self._item)
        return self._goto(self._closing)
