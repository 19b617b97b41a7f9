"""The lark grammar of a forced tool call in the Hermes format (Qwen, and the tiny test models' template):

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

one call, or with parallel calls one or more separated by a newline. Each tool's arguments are an embedded
``%json`` schema, so they follow that tool's own parameters.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from mlxd.constraints.schema import close_objects, find_ref_cycle, with_json_options
from mlxd.errors import RequestError

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"

# What a function name may hold, whatever the model's tool-call format: OpenAI's and Anthropic's characters, and
# ``.`` and ``:`` (namespaced MCP tools). Every format's markup (``<tool_call>``, ``[TOOL_CALLS]``, ``<|call|>``,
# DeepSeek's full-width bars, quotes, brackets, whitespace) lies outside it, so a name can neither forge nor break
# a call.
TOOL_NAME = re.compile(r"[A-Za-z0-9_.:-]{1,128}")

# OpenAI: a function without ``parameters`` takes an empty parameter list.
_NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}


def select_tools(tools: list[dict[str, Any]], choice: str | dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The tools a call may name, ``{name: parameters schema}`` in request order.

    ``tools`` are OpenAI tool objects (``{"type": "function", "function": {"name", "parameters", "strict"}}``; a
    bare function object is taken too); ``choice`` is ``"required"`` (any of them) or
    ``{"type": "function", "function": {"name": ...}}`` (that one). A function with ``strict: true`` has its
    objects closed (:func:`close_objects`). ``RequestError`` (param ``tools`` or ``tool_choice``) names what is
    wrong.
    """
    if not tools:
        raise RequestError("tool_choice needs at least one tool in tools", param="tool_choice")
    functions: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools):
        name, parameters = _function(tool, i)
        if name in functions:
            raise RequestError(f"tools[{i}]: duplicate function name {name!r}", param=f"tools[{i}].function.name")
        functions[name] = parameters
    if choice == "required":
        return functions
    name = _chosen_name(choice)
    if name not in functions:
        raise RequestError(f"tool_choice names function {name!r}, which is not among tools: "
                           f"{', '.join(map(repr, functions))}", param="tool_choice")
    return {name: functions[name]}


def tool_call_lark(functions: dict[str, dict[str, Any]], *, parallel: bool,
                   marker: Callable[[str], str]) -> str:
    """The lark grammar of one tool call (or, with ``parallel``, one or more) naming one of ``functions``.

    ``marker(text)`` is the lark expression for a markup string such as ``<tool_call>``: the literal, or the
    literal or its special token when the tokenizer has one.
    """
    lines = [
        'start: call ("\\n" call)*' if parallel else "start: call",
        'call: tc_open "\\n{\\"name\\": " fn "}\\n" tc_close',
        f"tc_open: {marker(TOOL_CALL_OPEN)}",
        f"tc_close: {marker(TOOL_CALL_CLOSE)}",
        "fn: " + " | ".join(f"fn_{i}" for i in range(len(functions))),
    ]
    for i, (name, parameters) in enumerate(functions.items()):
        head = f"{json.dumps(name)}, \"arguments\": "
        lines.append(f"fn_{i}: {json.dumps(head)} args_{i}")
        lines.append(f"args_{i}: %json {json.dumps(parameters)}")
    return "\n".join(lines) + "\n"


def check_tool_names(tools: list[dict[str, Any]] | None) -> None:
    """Refuse a function name outside :data:`TOOL_NAME` (``RequestError`` naming ``tools[i].function.name``): it
    could hold, or break, the tool-call markup of the model's format."""
    for i, tool in enumerate(tools or []):
        function = tool.get("function", tool) if isinstance(tool, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        if isinstance(name, str):
            _check_name(name, i)


def _check_name(name: str, index: int) -> None:
    if not TOOL_NAME.fullmatch(name):
        raise RequestError(f"tools[{index}].function.name {name[:80]!r} is not a function name: use 1 to 128 of "
                           "the letters, digits and _ . : -", param=f"tools[{index}].function.name")


def tool_index(tools: list[dict[str, Any]], name: str) -> int:
    """The position in ``tools`` of the function called ``name`` (0 when it is not there)."""
    for i, tool in enumerate(tools):
        function = tool.get("function", tool) if isinstance(tool, dict) else None
        if isinstance(function, dict) and function.get("name") == name:
            return i
    return 0


def _function(tool: Any, index: int) -> tuple[str, dict[str, Any]]:
    """A tool's function name and its parameters schema, prepared for llguidance."""
    function = tool.get("function", tool) if isinstance(tool, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
        raise RequestError(f"tools[{index}] must be {{'type': 'function', 'function': {{'name': ...}}}}",
                           param=f"tools[{index}]")
    _check_name(function["name"], index)
    param = f"tools[{index}].function.parameters"
    parameters = function.get("parameters")
    if parameters is None:
        parameters = _NO_PARAMETERS
    if not isinstance(parameters, dict):
        raise RequestError(f"tools[{index}].function.parameters must be a JSON schema object", param=param)
    if (cycle := find_ref_cycle(parameters)) is not None:
        raise RequestError(f"tools[{index}].function.parameters has no finite instance: its $ref chain "
                           f"{cycle[:200]} leads back to itself", param=param)
    if function.get("strict"):
        parameters = close_objects(parameters)
    return function["name"], with_json_options(parameters, param=param)


def _chosen_name(choice: Any) -> str:
    function = choice.get("function") if isinstance(choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise RequestError(f"a forced tool call needs tool_choice 'required' or "
                           f"{{'type': 'function', 'function': {{'name': ...}}}}, got {choice!r}",
                           param="tool_choice")
    return name
