"""Seed-OSS (ByteDance-Seed/Seed-OSS-36B-Instruct) tool calls: Qwen3-Coder's XML body in Seed's own markers,
``<seed:tool_call>\\n<function=NAME>\\n<parameter=p>value</parameter>\\n</function>\\n</seed:tool_call>``, values typed
by the tool's schema."""

from __future__ import annotations

from mlxd.pipeline.parsers.tools.qwen3_coder import Qwen3CoderToolParser

OPEN, CLOSE = "<seed:tool_call>", "</seed:tool_call>"


class SeedOssToolParser(Qwen3CoderToolParser):
    """Reads calls as :class:`Qwen3CoderToolParser` does, between ``<seed:tool_call>`` and ``</seed:tool_call>``.
    A bare ``<tool_call>`` is text here: Seed-OSS writes only its own markers."""

    name = "seed_oss"
    special_markers = (OPEN, CLOSE)
    openers = (OPEN,)
    closers = {OPEN: CLOSE}

    @classmethod
    def matches(cls, chat_template: str) -> bool:
        return OPEN in chat_template
