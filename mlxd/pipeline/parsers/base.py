"""The parser contracts the ``parse`` stage drives. Parsers are plain Python: text in, typed events out.

A parser is built per request and fed the generated text in pieces, as the detokenizer produces it (a piece may
end anywhere, even inside a marker). It returns the events that are certain so far and holds back only text that
may still turn out to be markup; :meth:`finish` returns what is left at the end of the stream.
"""

from __future__ import annotations

import secrets
from typing import Any, ClassVar

from mlxd.pipeline.events import ContentDelta, ReasoningDelta, ToolCallDelta


def new_call_id() -> str:
    """An id for a tool call, in the shape OpenAI uses (``call_`` and 24 characters)."""
    return "call_" + secrets.token_hex(12)


class ToolParser:
    """Splits generated text into content and tool calls.

    ``tools`` are the request's tools (OpenAI shape: ``{"type": "function", "function": {"name", "parameters"}}``).
    A call to a name not among them is not a call: its text is returned as content. With no tools, every call
    is returned as content.

    Contract of :meth:`feed` and :meth:`finish`:
    - text that cannot be part of a call goes out as :class:`ContentDelta` at once; plain text with no possible
      start marker in sight pays nothing but a substring search;
    - a call goes out as a first :class:`ToolCallDelta` with ``index``, ``id`` and ``name`` as soon as the name
      is known, then argument fragments as they are generated; joined, they are the arguments as a JSON object;
    - no markup of a call (markers, the JSON envelope) ever appears in a ``ContentDelta``;
    - at the end of the stream, an unterminated call that has not been announced (no delta sent yet) is returned
      as a call when what was generated parses as complete JSON, else its text is returned as content; a call
      already announced stays a call, with the arguments generated so far (the response's finish reason, e.g.
      ``length``, tells the client it was cut). A format may hold a whole call back until it ends (Harmony's
      ``<|call|>`` ends the turn anyway) and decide then.
    """

    name: ClassVar[str] = ""
    # Special tokens (their text) that this format uses: the detokenizer must keep them for the parser.
    special_markers: ClassVar[tuple[str, ...]] = ()

    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        self.tools = {t["function"]["name"]: t["function"] for t in tools or [] if t.get("function")}
        self.num_calls = 0  # calls emitted so far (their first delta)

    @classmethod
    def matches(cls, chat_template: str) -> bool:
        """Whether a chat template renders tool calls in this parser's format (for ``tool_parser = "auto"``)."""
        return False

    def feed(self, text: str) -> list[ContentDelta | ToolCallDelta | ReasoningDelta]:
        raise NotImplementedError

    def finish(self) -> list[ContentDelta | ToolCallDelta | ReasoningDelta]:
        raise NotImplementedError


class ReasoningParser:
    """Splits generated text into reasoning and content.

    ``in_reasoning``: the prompt already opened the reasoning block (templates that end the generation prompt with
    ``<think>``), so generated text is reasoning until the block closes. Same streaming contract as
    :class:`ToolParser`: markers never reach either kind of delta.
    """

    name: ClassVar[str] = ""
    special_markers: ClassVar[tuple[str, ...]] = ()

    def __init__(self, in_reasoning: bool = False) -> None:
        self.in_reasoning = in_reasoning

    @classmethod
    def matches(cls, chat_template: str) -> bool:
        return False

    @classmethod
    def opens_in_prompt(cls, prompt_text: str) -> bool:
        """Whether the rendered prompt leaves a reasoning block open for the model to continue."""
        return False

    def feed(self, text: str) -> list[ContentDelta | ReasoningDelta]:
        raise NotImplementedError

    def finish(self) -> list[ContentDelta | ReasoningDelta]:
        raise NotImplementedError
