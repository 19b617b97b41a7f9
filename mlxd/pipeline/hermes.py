"""Tools for chat templates that do not render them all themselves.

- A template with no tool format at all (``tool_mode`` ``"hermes"``): the template stage rewrites the conversation
  before rendering it. The tool list goes into the system message (Qwen2.5's wording and ``<tools>`` block), earlier
  assistant tool calls become ``<tool_call>`` JSON in the assistant's text, tool results become
  ``<tool_response>`` blocks in a user turn. The model is asked for, and constrained decoding emits, ``<tool_call>``
  JSON, which the ``hermes`` tool parser reads back.
- A template that renders calls and results in its own format but not the tool list (DeepSeek's published ones,
  ``"list"``): only the list is added to the system message; the model writes calls in its own format.
"""

from __future__ import annotations

import json
from typing import Any

_INSTRUCTIONS = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within <tool_call></tool_call> "
    "XML tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": <args-json-object>}}\n</tool_call>"
)


_LISTING = "# Tools\n\nYou can call these functions:\n{tools}"


def tool_mode(chat_template: Any) -> str:
    """``"native"``: the template renders the tool list (its source refers to ``tools``); ``"list"``: it renders
    calls (``tool_calls``) but not the list; ``"hermes"``: it knows no tools."""
    sources = chat_template.values() if isinstance(chat_template, dict) else [chat_template]
    text = "\n".join(source for source in sources if isinstance(source, str))
    if "tools" in text:
        return "native"
    return "list" if "tool_calls" in text else "hermes"


def tool_list_in_system(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation with the tool list added to its system message (a new one when it has none)."""
    return _with_system(list(messages), _LISTING.format(tools="\n".join(json.dumps(t, ensure_ascii=False)
                                                                       for t in tools)))


def _with_system(messages: list[dict[str, Any]], block: str) -> list[dict[str, Any]]:
    if messages and messages[0]["role"] == "system":
        messages[0] = {**messages[0], "content": f"{_text(messages[0].get('content'))}\n\n{block}"}
    else:
        messages.insert(0, {"role": "system", "content": block})
    return messages


def tools_in_messages(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """The conversation with tools, tool calls and tool results written out as Hermes text."""
    out = [_plain(message) for message in messages]
    if tools:
        listing = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
        out = _with_system(out, _INSTRUCTIONS.format(tools=listing))
    return _merge_tool_results(out)


def _plain(message: dict[str, Any]) -> dict[str, Any]:
    if message.get("role") == "assistant" and message.get("tool_calls"):
        calls = [_call_text(call) for call in message["tool_calls"]]
        text = _text(message.get("content"))
        return {"role": "assistant", "content": "\n".join([text, *calls] if text else calls)}
    if message.get("role") == "tool":
        return {"role": "tool", "content": f"<tool_response>\n{_text(message.get('content'))}\n</tool_response>"}
    return message


def _call_text(call: dict[str, Any]) -> str:
    function = call.get("function") or {}
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            pass
    payload = {"name": function.get("name"), "arguments": arguments if arguments is not None else {}}
    return f"<tool_call>\n{json.dumps(payload, ensure_ascii=False)}\n</tool_call>"


def _merge_tool_results(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Tool results become user turns (templates without tools know no ``tool`` role); consecutive ones share one."""
    out: list[dict[str, Any]] = []
    for message in messages:
        if message["role"] != "tool":
            out.append(message)
        elif out and out[-1].get("from_tools"):
            out[-1] = {**out[-1], "content": out[-1]["content"] + "\n" + message["content"]}
        else:
            out.append({"role": "user", "content": message["content"], "from_tools": True})
    return [{k: v for k, v in m.items() if k != "from_tools"} for m in out]


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text") or "" for p in content if isinstance(p, dict))
    return ""
