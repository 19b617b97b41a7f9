"""Calls written as JSON: a scanner that finds where a JSON (or Python) value ends as its text streams in, a reader
of a call object's head (``{"name": "f", "arguments": ``), and the states that stream a call's arguments."""

from __future__ import annotations

import json
import re
from typing import Any, ClassVar

from mlxd.pipeline.parsers.tools.streaming import State, StreamingToolParser, skip_ws

ARGS_KEYS = ("arguments", "parameters")


class Syntax:
    """The characters a :class:`Scanner` tracks: string quotes and brackets."""

    def __init__(self, quotes: str, opening: str, closing: str) -> None:
        self.opening = opening
        self.outside = re.compile("[" + re.escape(quotes + opening + closing) + "]")
        self.inside = {q: re.compile("[" + re.escape("\\" + q) + "]") for q in quotes}


JSON = Syntax('"', "{[", "}]")
PYTHON = Syntax("\"'", "([{", ")]}")


class Scanner:
    """Follows one bracketed value as its text arrives, to tell where it ends. It tracks brackets and strings only:
    whether the text is valid JSON (or Python) is for the parser of the whole value to say.

    ``depth`` > 0 starts the scanner inside that many brackets (to skip the rest of an enclosing object).
    """

    __slots__ = ("bad", "depth", "escape", "quote", "syntax")

    def __init__(self, depth: int = 0, syntax: Syntax = JSON) -> None:
        self.depth, self.syntax = depth, syntax
        self.quote = ""
        self.escape = False
        self.bad = False  # the value does not start with an opening bracket

    def feed(self, text: str, pos: int = 0) -> int | None:
        """Scan ``text[pos:]``; the index just past the value's end when it ends there, else None (also when bad)."""
        if self.depth == 0 and not self.bad:
            pos = skip_ws(text, pos)
            self.bad = pos < len(text) and text[pos] not in self.syntax.opening
        while not self.bad and pos < len(text):
            if self.escape:
                self.escape, pos = False, pos + 1
            elif self.quote:
                pos = self._in_string(text, pos)
            else:
                pos = self._out_of_string(text, pos)
                if self.depth == 0:
                    return pos
        return None

    def _in_string(self, text: str, pos: int) -> int:
        m = self.syntax.inside[self.quote].search(text, pos)
        if m is None:
            return len(text)
        if m.group() == "\\":
            self.escape = True
        else:
            self.quote = ""
        return m.end()

    def _out_of_string(self, text: str, pos: int) -> int:
        m = self.syntax.outside.search(text, pos)
        if m is None:
            return len(text)
        char = m.group()
        if char in self.syntax.opening:
            self.depth += 1
        elif char in self.syntax.inside:
            self.quote = char
        else:
            self.depth -= 1
        return m.end()


class NeedMore(Exception):
    """The text so far is a beginning of what is expected."""


class NotCanonical(Exception):
    """The text is not (or not in the expected order) what is expected."""


_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.S)


def _token(text: str, pos: int, literal: str) -> int:
    pos = skip_ws(text, pos)
    if text.startswith(literal, pos):
        return pos + len(literal)
    if literal.startswith(text[pos:pos + len(literal)]) and len(text) - pos < len(literal):
        raise NeedMore
    raise NotCanonical


def _string(text: str, pos: int) -> tuple[Any, int]:
    pos = skip_ws(text, pos)
    if pos == len(text):
        raise NeedMore
    if text[pos] != '"':
        raise NotCanonical
    m = _STRING.match(text, pos)
    if m is None:
        raise NeedMore
    try:
        return json.loads(m.group()), m.end()
    except ValueError as e:
        raise NotCanonical from e


def read_call_head(text: str, pos: int, args_keys: tuple[str, ...] = ARGS_KEYS) -> tuple[str, int]:
    """Read ``{"name": "<name>", "<args key>": `` from ``text[pos:]``: the name and the index of the ``{`` that opens
    the arguments. Raises :class:`NeedMore` while the text is a beginning of that, else :class:`NotCanonical`."""
    pos = _token(text, pos, "{")
    key, pos = _string(text, pos)
    if key != "name":
        raise NotCanonical
    name, pos = _string(text, _token(text, pos, ":"))
    key, pos = _string(text, _token(text, pos, ","))
    if key not in args_keys:
        raise NotCanonical
    pos = skip_ws(text, _token(text, pos, ":"))
    if pos == len(text):
        raise NeedMore
    if text[pos] != "{":
        raise NotCanonical
    return name, pos


def call_from_json(text: str, args_keys: tuple[str, ...] = ARGS_KEYS,
                   require_arguments: bool = False) -> tuple[str, dict[str, Any]] | None:
    """The name and arguments of a call object's JSON text (keys in any order, arguments possibly a JSON string,
    ``{"function": {...}}`` unwrapped; without ``require_arguments``, no arguments key means none); None when it is
    not one."""
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    if isinstance(obj, dict) and isinstance(obj.get("function"), dict) and "name" not in obj:
        obj = obj["function"]
    if not isinstance(obj, dict) or (require_arguments and not any(k in obj for k in args_keys)):
        return None
    args = next((obj[k] for k in args_keys if k in obj), {})
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    name = obj.get("name")
    return (name, args) if isinstance(name, str) and isinstance(args, dict) else None


class JsonCallParser(StreamingToolParser):
    """A parser with the states that read one call object ``{"name": ..., "arguments": {...}}`` from ``self._pos``.

    Written name-first, the call is announced once its head is read and its arguments' text streams out as it
    arrives; otherwise the object is read whole, then announced with its arguments in one fragment. After the
    object, the parser goes to ``self._after_call``.
    """

    args_keys: ClassVar[tuple[str, ...]] = ARGS_KEYS
    # Whether an object with a name but no arguments key is a call (with none) or text.
    require_arguments: ClassVar[bool] = False

    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        super().__init__(tools)
        self._scanner = Scanner()
        self._scanned = 0
        self._then: State = self._closing
        self._after_call: State = self._closing

    def _json_call(self, final: bool) -> bool:
        try:
            name, at = read_call_head(self._buf, self._pos, self.args_keys)
        except NeedMore:
            return False
        except NotCanonical:
            return self._read_whole()
        if name not in self.tools:
            # A region with no closing marker ends with its object: read it whole to know where.
            return self._reject() if self._closer else self._read_whole()
        self._announce(name)
        return self._stream_args(at, then=self._json_rest)

    def _stream_args(self, at: int, then: State) -> bool:
        """Stream the arguments object starting at ``self._buf[at]`` (after an announcement), then go to ``then``."""
        self._consume(at)
        self._scanner, self._then = Scanner(), then
        return self._goto(self._json_args)

    def _json_args(self, final: bool) -> bool:
        end = self._scanner.feed(self._buf)
        if end is None:
            self._arguments(self._buf)
            self._consume(len(self._buf))
            return False
        self._arguments(self._buf[:end])
        self._consume(end)
        self._scanner = Scanner(depth=1)  # for the rest of an enclosing call object
        return self._goto(self._then)

    def _json_rest(self, final: bool) -> bool:
        """The rest of the call object after its arguments (other keys, the closing brace) is dropped."""
        end = self._scanner.feed(self._buf)
        self._consume(len(self._buf) if end is None else end)
        return end is not None and self._goto(self._after_call)

    def _read_whole(self) -> bool:
        self._scanner, self._scanned = Scanner(), self._pos
        return self._goto(self._json_whole)

    def _json_whole(self, final: bool) -> bool:
        end = self._scanner.feed(self._buf, self._scanned)
        if end is None:
            self._scanned = len(self._buf)
            return self._scanner.bad and self._reject()
        call = call_from_json(self._buf[self._pos:end], self.args_keys, self.require_arguments)
        if call is None or call[0] not in self.tools:
            return self._reject(None if self._closer else end)
        self._announce(call[0])
        self._arguments(json.dumps(call[1], ensure_ascii=False))
        self._consume(end)
        return self._goto(self._after_call)
