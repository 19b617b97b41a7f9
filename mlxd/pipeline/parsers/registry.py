"""Parser lookup by name, and ``"auto"``: the parsers a chat template calls for."""

from __future__ import annotations

from typing import Any

from mlxd.errors import ConfigError
from mlxd.pipeline.hermes import tool_mode
from mlxd.pipeline.parsers.base import ReasoningParser, ToolParser
from mlxd.pipeline.parsers.harmony import HarmonyParser
from mlxd.pipeline.parsers.reasoning import REASONING_PARSERS, detect_reasoning_parser
from mlxd.pipeline.parsers.tools import TOOL_PARSERS, detect_tool_parser

ALL_TOOL_PARSERS: dict[str, type[ToolParser]] = {"harmony": HarmonyParser, **TOOL_PARSERS}


def _source(chat_template: Any) -> str:
    if isinstance(chat_template, dict):
        return "\n".join(s for s in chat_template.values() if isinstance(s, str))
    return chat_template if isinstance(chat_template, str) else ""


def tool_parser_for(name: str, chat_template: Any) -> type[ToolParser] | None:
    """The tool parser named in the config; ``"auto"``: the format the chat template renders (Hermes when the
    template knows no tools, as mlxd then writes them in the Hermes form; ``generic`` when it renders tools in a
    format no parser recognises); ``"none"``: no tool parsing."""
    if name == "none":
        return None
    if name != "auto":
        return _lookup(ALL_TOOL_PARSERS, name, "tool_parser")
    source = _source(chat_template)
    if HarmonyParser.matches(source):
        return HarmonyParser
    found = detect_tool_parser(source)
    if found is not None:
        return found
    return TOOL_PARSERS["hermes"] if tool_mode(source) == "hermes" else TOOL_PARSERS["generic"]


def reasoning_parser_for(name: str, chat_template: Any) -> type[ReasoningParser] | None:
    """The reasoning parser named in the config; ``"auto"``: the one the chat template calls for, if any."""
    if name == "none":
        return None
    if name != "auto":
        return _lookup(REASONING_PARSERS, name, "reasoning_parser")
    return detect_reasoning_parser(_source(chat_template))


def _lookup(registry: dict[str, type], name: str, option: str) -> type:
    if name not in registry:
        known = ", ".join(["auto", "none", *registry])
        raise ConfigError(f"parse stage: {option} = {name!r} is not a known parser; known: {known}")
    return registry[name]
