"""Streaming tool-call parsers, one per model family, by registry name.

``TOOL_PARSERS`` is in the order ``tool_parser = "auto"`` tries them: the first whose ``matches(chat_template)``
is true wins, so formats whose templates also carry a more general marker (``<tool_call>``) come before it, and
the generic fallback comes last.
"""

from __future__ import annotations

from mlxd.pipeline.parsers.base import ToolParser
from mlxd.pipeline.parsers.tools.deepseek import DeepSeekToolParser
from mlxd.pipeline.parsers.tools.generic import GenericToolParser
from mlxd.pipeline.parsers.tools.glm45 import Glm45ToolParser
from mlxd.pipeline.parsers.tools.hermes import HermesToolParser
from mlxd.pipeline.parsers.tools.llama3 import Llama3JsonToolParser
from mlxd.pipeline.parsers.tools.mistral import MistralToolParser
from mlxd.pipeline.parsers.tools.pythonic import PythonicToolParser
from mlxd.pipeline.parsers.tools.qwen3_coder import Qwen3CoderToolParser
from mlxd.pipeline.parsers.tools.seed_oss import SeedOssToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    cls.name: cls
    for cls in (
        SeedOssToolParser,  # <seed:tool_call>, with Qwen3-Coder's <function=...> inside
        Qwen3CoderToolParser,  # <tool_call> with <function=...>
        Glm45ToolParser,  # <tool_call> with <arg_key>
        DeepSeekToolParser,
        MistralToolParser,
        PythonicToolParser,  # before llama3: Llama templates of both kinds have Llama's headers
        Llama3JsonToolParser,
        HermesToolParser,  # any other <tool_call>
        GenericToolParser,  # any template that renders tools at all
    )
}


def detect_tool_parser(chat_template: str | None) -> type[ToolParser] | None:
    """The parser for the tool-call format a chat template renders: the first of :data:`TOOL_PARSERS` that matches
    it. None for no template, or one that does nothing with tools."""
    if not chat_template:
        return None
    return next((cls for cls in TOOL_PARSERS.values() if cls.matches(chat_template)), None)


__all__ = ["TOOL_PARSERS", "detect_tool_parser"]
