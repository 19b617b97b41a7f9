"""Where a rendered prompt is worth a prefix-cache snapshot, as token positions (``Job.checkpoints``).

Caches that cannot be trimmed (recurrent layers: hybrid models) are only reused where a snapshot was taken, so the
``template`` stage names the positions where another request is likely to part from this one:

- **The end of the system prompt and tool definitions**, on every surface: a new conversation with the same system
  prompt and tools reuses that whole block. Found by rendering the leading system messages alone (with the tools)
  and checking that the prompt starts with that text; where it does not (templates that put tools in the first
  user message, or refuse a conversation without one), by a marker at the start of the first other message.
- **Client cache breakpoints**: an Anthropic ``cache_control`` on a text block (system or message) or a tool result
  ends its text with a :class:`Breakpoints` marker (placed by the API); the template stage renders the marked
  messages, finds each marker and removes it. A marker that changes how the template renders the rest (a template
  that trims or tests the content) is dropped, not guessed at: the marked render less its markers must equal the
  prompt. ``cache_control`` on a tool is the end of the tool definitions above.
- **``prompt_cache_key``** (OpenAI): requests sharing a key snapshot where they part from the key's previous
  request (:class:`SharedPrefixes`): the longest token prefix they share, so that the next request of that family
  reuses all of it, wherever in a message it ends.

Each text position becomes a token position only where the prompt's tokens split there exactly: the tokens of the
text before it are the prompt's first tokens, or those of the text after it its last ones (a position inside a
merged token is dropped).
"""

from __future__ import annotations

import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

_MARK = "[[mlxd-cache-point:{request_id}:{index}]]"


class Breakpoints:
    """Markers for one request's cache breakpoints, written into its message text by the API; the ``template``
    stage finds them in the rendered prompt and removes them from the messages (:func:`strip_marks`)."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.marks: list[str] = []

    def after(self, text: str) -> str:
        """``text`` followed by a new marker: a breakpoint where ``text`` ends."""
        mark = _MARK.format(request_id=self.request_id, index=len(self.marks))
        self.marks.append(mark)
        return text + mark


def _pattern(marks: Sequence[str]) -> re.Pattern[str]:
    return re.compile("|".join(re.escape(m) for m in marks))


def strip_marks(messages: list[dict[str, Any]], marks: Sequence[str]) -> list[dict[str, Any]]:
    """``messages`` without the markers (text content and text parts); messages without one are kept as they are."""
    if not marks:
        return messages
    pattern = _pattern(marks)
    return [_map_text(m, lambda text: pattern.sub("", text)) for m in messages]


def keep_only(messages: list[dict[str, Any]], marks: Sequence[str], keep: str) -> list[dict[str, Any]]:
    """``messages`` with every marker but ``keep`` removed."""
    return strip_marks(messages, [m for m in marks if m != keep])


def _map_text(message: dict[str, Any], fn: Callable[[str], str]) -> dict[str, Any]:
    content = message.get("content")
    if isinstance(content, str):
        new = fn(content)
        return message if new == content else {**message, "content": new}
    if isinstance(content, list):
        parts = [{**p, "text": fn(p["text"])} if isinstance(p, dict) and isinstance(p.get("text"), str) else p
                 for p in content]
        return {**message, "content": parts}
    return message


def locate_marks(marked_text: str, marks: Sequence[str], prompt_text: str) -> dict[str, int]:
    """Each marker's offset in ``prompt_text``, from a render of the marked messages: empty unless that render
    less its markers is exactly ``prompt_text`` (a marker must not change how the template renders the rest)."""
    if not marks:
        return {}
    found: dict[str, int] = {}
    removed = 0
    pieces = []
    last = 0
    for match in _pattern(marks).finditer(marked_text):
        if match.group() in found:  # rendered twice (a template that repeats a message): no single position
            return {}
        pieces.append(marked_text[last:match.start()])
        found[match.group()] = match.start() - removed
        removed += match.end() - match.start()
        last = match.end()
    pieces.append(marked_text[last:])
    return found if "".join(pieces) == prompt_text else {}


def token_position(encode: Callable[[str], list[int]], prompt_text: str, prompt_ids: Sequence[int],
                   offset: int) -> int | None:
    """The token position where ``prompt_text[:offset]`` ends in ``prompt_ids``, when the prompt's tokens split
    there exactly: the text before it tokenizes to the prompt's first tokens, or the text after it to its last ones
    (the shorter text is tried first; the other where images, whose placeholders the prompt's tokens expand, are
    on the shorter side); else None."""
    if offset <= 0 or offset >= len(prompt_text):
        return None
    sides = (_from_head, _from_tail) if offset <= len(prompt_text) // 2 else (_from_tail, _from_head)
    for side in sides:
        position = side(encode, prompt_text, prompt_ids, offset)
        if position is not None:
            return position
    return None


def _from_head(encode: Callable[[str], list[int]], text: str, ids: Sequence[int], offset: int) -> int | None:
    head = encode(text[:offset])
    n = len(head)
    return n if 0 < n < len(ids) and list(ids[:n]) == head else None


def _from_tail(encode: Callable[[str], list[int]], text: str, ids: Sequence[int], offset: int) -> int | None:
    tail = encode(text[offset:])
    n = len(ids) - len(tail)
    return n if 0 < n < len(ids) and list(ids[n:]) == tail else None


class SharedPrefixes:
    """``prompt_cache_key``'s memory: the last prompt (token ids) seen with each key, for the keys used most
    recently, at most ``max_keys`` of them and ``max_tokens`` tokens together (4 bytes each). :meth:`shared` returns
    how many leading tokens a new prompt shares with its key's previous one and remembers the new prompt in its
    place; thread-safe."""

    def __init__(self, max_keys: int = 256, max_tokens: int = 1 << 23) -> None:
        self.max_keys = max_keys
        self.max_tokens = max_tokens
        self._prompts: OrderedDict[str, np.ndarray] = OrderedDict()
        self._num_tokens = 0
        self._lock = threading.Lock()

    def shared(self, key: str, prompt: Sequence[int]) -> int:
        tokens = np.asarray(prompt, dtype=np.int32)
        with self._lock:
            previous = self._prompts.pop(key, None)
            self._num_tokens += len(tokens) - (len(previous) if previous is not None else 0)
            self._prompts[key] = tokens
            while len(self._prompts) > 1 and (len(self._prompts) > self.max_keys
                                              or self._num_tokens > self.max_tokens):
                self._num_tokens -= len(self._prompts.popitem(last=False)[1])
        if previous is None:
            return 0
        n = min(len(previous), len(tokens))
        differ = np.flatnonzero(previous[:n] != tokens[:n])
        return int(differ[0]) if len(differ) else n
