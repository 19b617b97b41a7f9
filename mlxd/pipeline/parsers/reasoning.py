"""Reasoning parsers: split generated text into reasoning and content, by model family.

``REASONING_PARSERS`` maps the names a config uses to parser classes; :func:`detect_reasoning_parser` picks one
from a chat template (``reasoning_parser = "auto"``).
"""

from __future__ import annotations

from typing import ClassVar

from mlxd.pipeline.events import ContentDelta, ReasoningDelta
from mlxd.pipeline.parsers.base import ReasoningParser
from mlxd.pipeline.parsers.harmony import HarmonyReasoningParser

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
SEED_THINK_OPEN, SEED_THINK_CLOSE = "<seed:think>", "</seed:think>"
# Seed-OSS's thinking-budget reports inside its reasoning; a prompt with a budget of 0 ends with one opened.
SEED_BUDGET_OPEN = "<seed:cot_budget_reflect>"


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
    # The block's markers: a family that writes the same block with other markers subclasses with its own.
    open_marker: ClassVar[str] = THINK_OPEN
    close_marker: ClassVar[str] = THINK_CLOSE

    def __init__(self, in_reasoning: bool = False) -> None:
        super().__init__(in_reasoning)
        self._buffer = ""
        self._at_start = not in_reasoning  # the model may still open the block itself
        self._strip = False  # drop the whitespace that follows </think>

    @classmethod
    def matches(cls, chat_template: str) -> bool:
        """Templates that mention the opening or the closing marker."""
        return cls.open_marker in chat_template or cls.close_marker in chat_template

    @classmethod
    def opens_in_prompt(cls, prompt_text: str) -> bool:
        """True when the prompt ends with the opening marker (whitespace after it allowed) that nothing closes."""
        at = prompt_text.rfind(cls.open_marker)
        return at >= 0 and not prompt_text[at + len(cls.open_marker) :].strip()

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
        stripped, marker = self._buffer.lstrip(), self.open_marker
        if stripped.startswith(marker):
            self.in_reasoning = True
            self._buffer = stripped[len(marker) :]
        elif not stripped or marker.startswith(stripped):
            return False
        self._at_start = False
        return True

    def _reasoning(self, out: list[ContentDelta | ReasoningDelta]) -> None:
        buffer, marker = self._buffer, self.close_marker
        end = buffer.find(marker)
        if end < 0:
            end = len(buffer) - _partial_suffix(buffer, marker)
            self._buffer = buffer[end:]
        else:
            self._buffer = buffer[end + len(marker) :]
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


class SeedThinkParser(ThinkParser):
    """Seed-OSS reasoning: ``<seed:think>…</seed:think>``, read as :class:`ThinkParser` reads ``<think>``. The
    budget reports the model writes inside the block (``<seed:cot_budget_reflect>…``) are part of its reasoning."""

    name = "seed_oss"
    special_markers = (SEED_THINK_OPEN, SEED_THINK_CLOSE)
    open_marker = SEED_THINK_OPEN
    close_marker = SEED_THINK_CLOSE

    @classmethod
    def opens_in_prompt(cls, prompt_text: str) -> bool:
        """True when the prompt ends with ``<seed:think>`` that nothing closes, a budget report opened after it
        allowed (the template's generation prompt for a thinking budget of 0)."""
        at = prompt_text.rfind(SEED_THINK_OPEN)
        rest = prompt_text[at + len(SEED_THINK_OPEN) :].strip() if at >= 0 else None
        return rest is not None and rest.removeprefix(SEED_BUDGET_OPEN).strip() == ""


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    ThinkParser.name: ThinkParser,
    SeedThinkParser.name: SeedThinkParser,
    HarmonyReasoningParser.name: HarmonyReasoningParser,
}


def detect_reasoning_parser(chat_template: str | None) -> type[ReasoningParser] | None:
    """The reasoning parser whose format a chat template writes, or None. Harmony and Seed-OSS are checked first:
    their markers are specific, while ``<think>`` may appear in any template's text."""
    if not chat_template:
        return None
    for parser in (HarmonyReasoningParser, SeedThinkParser, ThinkParser):
        if parser.matches(chat_template):
            return parser
    return None
