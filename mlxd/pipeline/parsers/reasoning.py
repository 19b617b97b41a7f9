"""Reasoning parsers: split generated text into reasoning and content, by model family.

``REASONING_PARSERS`` maps the names a config uses to parser classes; :func:`detect_reasoning_parser` picks one
from a chat template (``reasoning_parser = "auto"``).
"""

from __future__ import annotations

from mlxd.pipeline.events import ContentDelta, ReasoningDelta
from mlxd.pipeline.parsers.base import ReasoningParser
from mlxd.pipeline.parsers.harmony import HarmonyReasoningParser

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that is a proper prefix of ``marker`` (text that may become it)."""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if text.endswith(marker[:size]):
            return size
    return 0


class ThinkParser(ReasoningParser):
    """``<think>…</think>`` reasoning (Qwen3, DeepSeek-R1, QwQ, GLM-4.5).

    Generated text is reasoning while a block is open: from the start when the prompt opened it
    (``in_reasoning``), or once the model opens it as the first thing it writes (leading whitespace allowed).
    The block ends at ``</think>``; the whitespace after it does not begin the content. A block still open at
    the end of the stream is all reasoning. Output with no block is content: only a possible ``<think>`` at the
    very start is held back, and text after the block is passed on as it comes (a later ``<think>`` is text).
    """

    name = "think"
    special_markers = (THINK_OPEN, THINK_CLOSE)

    def __init__(self, in_reasoning: bool = False) -> None:
        super().__init__(in_reasoning)
        self._buffer = ""
        self._at_start = not in_reasoning  # the model may still open the block itself
        self._strip = False  # drop the whitespace that follows </think>

    @classmethod
    def matches(cls, chat_template: str) -> bool:
        """Templates that mention ``<think>`` or ``</think>``."""
        return THINK_OPEN in chat_template or THINK_CLOSE in chat_template

    @classmethod
    def opens_in_prompt(cls, prompt_text: str) -> bool:
        """True when the prompt ends with ``<think>`` (whitespace after it allowed) that nothing closes."""
        at = prompt_text.rfind(THINK_OPEN)
        return at >= 0 and not prompt_text[at + len(THINK_OPEN) :].strip()

    def feed(self, text: str) -> list[ContentDelta | ReasoningDelta]:
        self._buffer += text
        out: list[ContentDelta | ReasoningDelta] = []
        if self._at_start and not self._decide_start():
            return out
        if self.in_reasoning:
            self._reasoning(out)
        if not self.in_reasoning:
            self._content(out)
        return out

    def finish(self) -> list[ContentDelta | ReasoningDelta]:
        """What is held: reasoning if the block is still open, else content (a partial marker is text)."""
        text, self._buffer = self._buffer, ""
        if not text:
            return []
        return [ReasoningDelta(text) if self.in_reasoning else ContentDelta(text)]

    def _decide_start(self) -> bool:
        """Whether the output opens a block; False while it cannot be told yet."""
        stripped = self._buffer.lstrip()
        if stripped.startswith(THINK_OPEN):
            self.in_reasoning = True
            self._buffer = stripped[len(THINK_OPEN) :]
        elif not stripped or THINK_OPEN.startswith(stripped):
            return False
        self._at_start = False
        return True

    def _reasoning(self, out: list[ContentDelta | ReasoningDelta]) -> None:
        buffer = self._buffer
        end = buffer.find(THINK_CLOSE)
        if end < 0:
            end = len(buffer) - _partial_suffix(buffer, THINK_CLOSE)
            self._buffer = buffer[end:]
        else:
            self._buffer = buffer[end + len(THINK_CLOSE) :]
            self.in_reasoning, self._strip = False, True
        if end:
            out.append(ReasoningDelta(buffer[:end]))

    def _content(self, out: list[ContentDelta | ReasoningDelta]) -> None:
        if self._strip:
            self._buffer = self._buffer.lstrip()
            if not self._buffer:
                return
            self._strip = False
        if self._buffer:
            out.append(ContentDelta(self._buffer))
            self._buffer = ""


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    ThinkParser.name: ThinkParser,
    HarmonyReasoningParser.name: HarmonyReasoningParser,
}


def detect_reasoning_parser(chat_template: str | None) -> type[ReasoningParser] | None:
    """The reasoning parser whose format a chat template writes, or None. Harmony is checked first: its markers
    are specific, while ``<think>`` may appear in any template's text."""
    if not chat_template:
        return None
    for parser in (HarmonyReasoningParser, ThinkParser):
        if parser.matches(chat_template):
            return parser
    return None
