"""Responses API requests → pipeline jobs, in the chat shape the pipeline reads.

``instructions`` become a system message first; ``input`` items become chat messages: messages (``developer`` kept
for ``normalize`` to map), ``function_call`` items an assistant message's tool calls (consecutive ones, and one right
after an assistant message, join that message), ``function_call_output`` items tool messages. History the prompt
cannot use is dropped and named in a log line: ``reasoning`` items silently (the template re-renders no thoughts),
hosted tools' calls (``web_search_call``, ``local_shell_call``, ``custom_tool_call``, ...) by kind. Likewise only
``function`` tools reach the template; hosted tools (``web_search``, ``local_shell``, ``custom``, ``mcp``, ...) are
dropped and named. What cannot be honoured without state or storage (``previous_response_id``, ``conversation``,
stored prompts, ``item_reference``, ``file_id``) is a 400 that says so. The rules shared with the other surfaces
(tool choice, sampling defaults, thinking, response format) are :mod:`mlxd.api.intent`'s.
"""

from __future__ import annotations

import json
import uuid
from collections import Counter
from typing import Any

import msgspec

from mlxd.api import intent
from mlxd.api.errors import clip
from mlxd.api.responses_schemas import (
    FunctionTool,
    InputFunctionCall,
    InputFunctionCallOutput,
    InputMessage,
    ResponseSettings,
    ResponsesRequest,
)
from mlxd.config.schema import SamplingDefaults
from mlxd.errors import RequestError
from mlxd.log import get_logger
from mlxd.pipeline.job import Job

log = get_logger("mlxd.api")

STATELESS = "mlxd is stateless and stores no responses"
LOGPROBS = "message.output_text.logprobs"
TEXT_PARTS = {"input_text": "text", "output_text": "text", "text": "text", "refusal": "refusal"}
# The Responses API's words for the tools a tool choice may name and for where the output format is set.
WORDS = intent.Words(tool="function tool", format="text.format", format_schema="schema", format_param="text")
# Items that are history of tools mlxd does not run, or of reasoning it does not re-render: left out of the prompt.
SILENTLY_DROPPED = frozenset({"reasoning"})


def new_response_id() -> str:
    return "resp_" + uuid.uuid4().hex


def responses_job(body: ResponsesRequest, model: str, defaults: SamplingDefaults) -> tuple[Job, ResponseSettings]:
    """The job for a Responses request, and the settings its response echoes. Raises :class:`RequestError` (400,
    naming the field) for what the server cannot honour; logs what it leaves out of the prompt."""
    _refuse_unsupported(body)
    request_id = new_response_id()
    tools, echoed_tools = _tools(body.tools, request_id)
    choice, tools, echoed_tools = _tool_choice(body.tool_choice, tools, echoed_tools)
    job = Job(
        request_id=request_id,
        model=model,
        messages=_messages(body.instructions, body.input, request_id),
        tools=tools,
        template_kwargs=intent.thinking_switches(effort=body.reasoning.effort if body.reasoning else None),
        max_tokens=body.max_output_tokens,
        clamp_max_tokens=True,
        sampling=intent.sampling(defaults, temperature=body.temperature, top_p=body.top_p),
        tool_choice=choice,
        parallel_tool_calls=body.parallel_tool_calls is not False,
        response_format=_response_format(body),
        prompt_cache_key=body.prompt_cache_key,
    )
    return job, _settings(body, model, job, echoed_tools)


def _refuse_unsupported(body: ResponsesRequest) -> None:
    if body.previous_response_id is not None:
        raise RequestError(f"previous_response_id is not supported: {STATELESS}; send the whole conversation in "
                           "`input` (earlier output items included)", param="previous_response_id")
    if body.conversation is not None:
        raise RequestError(f"conversation is not supported: {STATELESS}; send the whole conversation in `input`",
                           param="conversation")
    if body.prompt is not None:
        raise RequestError(f"prompt (a stored prompt template) is not supported: {STATELESS}; send `instructions` "
                           "and `input` instead", param="prompt")
    if body.background:
        raise RequestError(f"background: true is not supported: {STATELESS}; use stream: true for long responses",
                           param="background")
    if body.include and LOGPROBS in body.include:
        raise RequestError(f"include {LOGPROBS!r} is not supported on /v1/responses; /v1/chat/completions returns "
                           "logprobs", param="include")


def _settings(body: ResponsesRequest, model: str, job: Job, tools: list[dict[str, Any]]) -> ResponseSettings:
    text: dict[str, Any] = {"format": {"type": "text"}}
    if body.text is not None:
        text = {**text, **msgspec.to_builtins(body.text)}
    return ResponseSettings(
        model=model,
        instructions=body.instructions,
        max_output_tokens=body.max_output_tokens,
        parallel_tool_calls=job.parallel_tool_calls,
        reasoning=msgspec.to_builtins(body.reasoning) if body.reasoning is not None else None,
        temperature=job.sampling.temperature,
        text=text,
        tool_choice=body.tool_choice or "auto",
        tools=tools,
        top_p=job.sampling.top_p,
        user=body.user,
        metadata=body.metadata or {},
    )


def _convert(item: Any, type_: type, where: str) -> Any:
    try:
        return msgspec.convert(item, type_, strict=True)
    except msgspec.ValidationError as e:
        raise RequestError(f"invalid {where}: {e}", param=where) from e


# ---- input → messages ----


def _messages(instructions: str | None, items: str | list[dict[str, Any]], request_id: str) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = [{"role": "system", "content": instructions}] if instructions else []
    if isinstance(items, str):
        return [*messages, {"role": "user", "content": items}]
    intent.check_not_empty(items, "input")
    dropped: Counter[str] = Counter()
    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            message = _convert(item, InputMessage, where)
            messages.append({"role": message.role, "content": _content(message.content, where)})
        elif kind == "function_call":
            _add_call(messages, _convert(item, InputFunctionCall, where))
        elif kind == "function_call_output":
            result = _convert(item, InputFunctionCallOutput, where)
            messages.append({"role": "tool", "tool_call_id": result.call_id, "content": _content(result.output, where)})
        elif kind == "item_reference":
            raise RequestError(f"item_reference is not supported: {STATELESS}; send the item itself", param=where)
        elif kind not in SILENTLY_DROPPED:
            dropped[str(kind)] += 1
    if dropped:
        log.info("responses_input_dropped", request_id=request_id, items=dict(dropped))
    if not messages:
        raise RequestError("`input` holds no message, function call or function call output, and there are no "
                           "`instructions`: nothing to answer", param="input")
    return messages


def _add_call(messages: list[dict[str, Any]], call: InputFunctionCall) -> None:
    arguments = call.arguments if isinstance(call.arguments, str) else json.dumps(call.arguments, ensure_ascii=False)
    tool_call = {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": arguments}}
    last = messages[-1] if messages else None
    if last is not None and last["role"] == "assistant":
        last.setdefault("tool_calls", []).append(tool_call)
    else:
        messages.append({"role": "assistant", "content": "", "tool_calls": [tool_call]})


def _content(content: str | list[dict[str, Any]], where: str) -> str | list[dict[str, Any]]:
    """Message or tool-output content as chat content: a string, or chat parts (text, ``image_url``)."""
    if isinstance(content, str):
        return content
    return [_part(part, f"{where}.content[{j}]") for j, part in enumerate(content)]


def _part(part: Any, where: str) -> dict[str, Any]:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind in TEXT_PARTS:
        text = part.get(TEXT_PARTS[kind])
        if not isinstance(text, str):
            raise RequestError(f"a {kind!r} part needs `{TEXT_PARTS[kind]}`, a string", param=where)
        return {"type": "text", "text": text}
    if kind == "input_image":
        url = part.get("image_url")
        if not isinstance(url, str):
            why = "; `file_id` needs file storage, which mlxd does not have" if part.get("file_id") else ""
            raise RequestError(f"an input_image part needs `image_url` (a URL or a data: URI){why}", param=where)
        image = {"url": url, **({"detail": part["detail"]} if part.get("detail") else {})}
        return {"type": "image_url", "image_url": image}
    raise RequestError(f"content part type {clip(str(kind))!r} is not supported; the supported types are "
                       "input_text, input_image, output_text and refusal", param=where)


# ---- tools, tool_choice, reasoning, text.format ----


def _tools(tools: list[dict[str, Any]] | None, request_id: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The function tools, in the chat shape (for the template) and in the Responses shape (echoed back)."""
    chat, echoed, dropped = [], [], []
    for i, tool in enumerate(tools or []):
        kind = tool.get("type")
        if kind != "function":
            dropped.append(str(kind))
            continue
        spec = _convert(tool, FunctionTool, f"tools[{i}]")
        function = {"name": spec.name, "description": spec.description,
                    "parameters": spec.parameters or {"type": "object", "properties": {}}, "strict": spec.strict}
        chat.append({"type": "function", "function": {k: v for k, v in function.items() if v is not None}})
        echoed.append({"type": "function", **function})
    if dropped:
        log.info("responses_tools_dropped", request_id=request_id, tools=dropped)
    return chat, echoed


def _tool_choice(choice: str | dict[str, Any] | None, tools: list[dict[str, Any]], echoed: list[dict[str, Any]]
                 ) -> tuple[str | dict[str, Any], list[dict[str, Any]] | None, list[dict[str, Any]]]:
    """The chat-shaped ``tool_choice``, the tools the template sees, and the tools the response echoes, once
    ``allowed_tools`` has picked some."""
    if isinstance(choice, dict) and choice.get("type") == "allowed_tools" and choice.get("mode", "auto") in (
            "auto", "required"):
        allowed = {t.get("name") for t in choice.get("tools") or [] if isinstance(t, dict)}
        keep = [i for i, name in enumerate(intent.tool_names(tools)) if name in allowed]
        tools, echoed, choice = [tools[i] for i in keep], [echoed[i] for i in keep], choice.get("mode", "auto")
    resolved, shown = intent.resolve_tool_choice(_parse_tool_choice(choice), tools, WORDS)
    return resolved, shown, echoed


def _parse_tool_choice(choice: str | dict[str, Any] | None) -> intent.ToolChoice:
    if (plain := intent.plain_tool_choice(choice)) is not None:
        return plain
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind == "function":
        return intent.ToolChoice("named", name=choice.get("name"))
    if isinstance(kind, str):
        raise RequestError(f"tool_choice {{'type': {clip(kind)!r}}} forces a tool mlxd cannot run; only function "
                           "tools are served", param="tool_choice")
    raise RequestError(f"tool_choice must be 'auto', 'none', 'required', {{'type': 'function', 'name': ...}} or "
                       f"{{'type': 'allowed_tools', ...}}, got {clip(str(choice))!r}", param="tool_choice")


def _response_format(body: ResponsesRequest) -> dict[str, Any] | None:
    fmt = body.text.format if body.text is not None else None
    if fmt is None:
        return None
    return intent.response_format(fmt.type, fmt.schema, strict=fmt.strict, name=fmt.name, words=WORDS)
