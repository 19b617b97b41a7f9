"""Anthropic Messages request bodies → pipeline jobs: OpenAI-shaped chat messages, tools and switches.

The pipeline speaks the OpenAI chat shape (plain dicts), so a request is translated once, here:

- ``system`` becomes the first, ``system`` message; ``system`` messages in mid-conversation stay where they are
  (``normalize`` decides how the template shows them). Text blocks are concatenated as sent: clients that split
  a system prompt into blocks (for cache breakpoints) write their own separators, as Claude Code does. Claude
  Code's ``x-anthropic-billing-header`` block is left out: it may change with every request and, at the very
  start of the prompt, would defeat the prefix cache.
- User ``text`` / ``image`` blocks become content parts (an image's base64 source a ``data:`` URI); each
  ``tool_result`` becomes a ``tool`` message answering ``tool_use_id`` (``is_error`` prefixes its content with
  ``Error:``, since chat templates have no place for the flag).
- Assistant ``text`` blocks are joined into ``content``; ``tool_use`` blocks become ``tool_calls`` (arguments: the
  input as JSON); ``thinking`` blocks become ``reasoning_content``, which templates that keep reasoning in the
  current turn's history (Qwen3's) render as the model wrote it; ``redacted_thinking`` is opaque and dropped.
- Tools Anthropic defines or runs (a ``type`` other than ``custom``) are left out of the prompt and named in a
  log line; ``tool_choice`` ``any`` is ``required``, ``tool`` a named function.
- ``thinking`` ``enabled`` / ``adaptive`` / ``disabled`` sets the template's ``enable_thinking``; absent, the
  template's default stands.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from mlxd.api.anthropic_schemas import (
    Base64Source,
    CountTokensRequest,
    FileSource,
    ImageBlock,
    MessageParam,
    MessagesRequest,
    PromptFields,
    RedactedThinkingBlock,
    TextBlock,
    ThinkingBlock,
    ThinkingDisabled,
    Tool,
    ToolChoiceAny,
    ToolChoiceNone,
    ToolChoiceTool,
    ToolResultBlock,
    ToolUseBlock,
)
from mlxd.api.errors import clip
from mlxd.config.schema import SamplingDefaults
from mlxd.engine.base import SamplingParams
from mlxd.errors import RequestError
from mlxd.log import get_logger
from mlxd.pipeline.job import Job
from mlxd.pipeline.stage import ModelInfo
from mlxd.pipeline.stops import check_stops

log = get_logger("mlxd.api")

BILLING_HEADER = "x-anthropic-billing-header"


def new_message_id() -> str:
    return f"msg_{uuid.uuid4().hex[:24]}"


def messages_job(body: MessagesRequest, model: str, defaults: SamplingDefaults) -> Job:
    """The job of a ``/v1/messages`` request. ``max_tokens`` beyond what the context leaves is clamped (Anthropic
    clients send their model's whole output limit), not refused. Raises ``RequestError`` naming the field."""
    stops = check_stops(body.stop_sequences or [], "stop_sequences")
    job = prompt_job(body, model)
    job.max_tokens = body.max_tokens
    job.clamp_max_tokens = True
    job.stop = stops
    job.sampling = SamplingParams(
        temperature=defaults.temperature if body.temperature is None else body.temperature,
        top_p=defaults.top_p if body.top_p is None else body.top_p,
        top_k=defaults.top_k if body.top_k is None else body.top_k,
        min_p=defaults.min_p,
        repetition_penalty=defaults.repetition_penalty or 0.0,
    )
    return job


def prompt_job(body: MessagesRequest | CountTokensRequest, model: str) -> Job:
    """A job holding what shapes the prompt (messages, tools, tool choice, thinking switch): enough for
    ``/v1/messages/count_tokens``."""
    if not body.messages:
        raise RequestError("`messages` must not be empty", param="messages")
    if body.messages[-1].role == "assistant":
        raise RequestError("the last message must not be an assistant message: mlxd does not continue (prefill) "
                           "an assistant turn", param="messages")
    tools = _tools(body.tools)
    choice, parallel = _tool_choice(body, tools)
    return Job(
        request_id=new_message_id(),
        model=model,
        messages=chat_messages(body),
        tools=tools if choice != "none" else None,
        tool_choice=choice,
        parallel_tool_calls=parallel,
        template_kwargs=_template_kwargs(body),
    )


def check_top_k(body: MessagesRequest, info: ModelInfo | None) -> None:
    """A 400 when ``top_k`` is not below the model's vocabulary size (unknown before the model loads)."""
    vocab = info.vocab_size if info is not None else 0
    if vocab > 0 and body.top_k is not None and body.top_k >= vocab:
        raise RequestError(f"top_k must be below the vocabulary size {vocab} (0 is off), got {body.top_k}",
                           param="top_k")


def chat_messages(body: PromptFields) -> list[dict[str, Any]]:
    """The request's system prompt and messages as OpenAI-shaped chat messages."""
    out = []
    if (system := _system(body.system)) is not None:
        out.append({"role": "system", "content": system})
    for i, message in enumerate(body.messages):
        if message.role == "user":
            out.extend(_user(i, message))
        elif message.role == "assistant":
            out.append(_assistant(i, message))
        else:
            out.append({"role": "system", "content": _system(message.content, i) or ""})
    return out


def _system(system: str | list[Any] | None, index: int = 0) -> str | None:
    """A system prompt's text; ``index`` names a system message in mid-conversation in errors (the top-level
    ``system`` holds text blocks only: its schema checks that)."""
    if isinstance(system, str):
        return system or None
    texts = []
    for j, block in enumerate(system or []):
        if not isinstance(block, TextBlock):
            raise RequestError(f"system messages take text blocks, not {block.__struct_config__.tag}",
                               param=_where(index, j))
        if not block.text.startswith(BILLING_HEADER):
            texts.append(block.text)
    return "".join(texts) or None


def _user(index: int, message: MessageParam) -> list[dict[str, Any]]:
    """A user message: its tool results as ``tool`` messages, its text and images as a user message, in the order
    the blocks come."""
    if isinstance(message.content, str):
        return [{"role": "user", "content": message.content}]
    out: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    for j, block in enumerate(message.content):
        if isinstance(block, ToolResultBlock):
            if parts:
                out.append(_user_message(parts))
                parts = []
            out.append(_tool_result(index, j, block))
        elif isinstance(block, TextBlock | ImageBlock):
            parts.append(_part(index, j, block))
        elif not isinstance(block, ThinkingBlock | RedactedThinkingBlock):
            raise RequestError(f"a {block.__struct_config__.tag} block belongs in an assistant message",
                               param=_where(index, j))
    if parts or not out:
        out.append(_user_message(parts))
    return out


def _user_message(parts: list[dict[str, Any]]) -> dict[str, Any]:
    # A lone text block is sent as a string: the prompt every template renders most simply.
    if len(parts) == 1 and parts[0]["type"] == "text":
        return {"role": "user", "content": parts[0]["text"]}
    return {"role": "user", "content": parts}


def _assistant(index: int, message: MessageParam) -> dict[str, Any]:
    if isinstance(message.content, str):
        return {"role": "assistant", "content": message.content}
    texts, reasoning, calls = [], [], []
    for j, block in enumerate(message.content):
        if isinstance(block, TextBlock):
            texts.append(block.text)
        elif isinstance(block, ThinkingBlock):
            reasoning.append(block.thinking)
        elif isinstance(block, ToolUseBlock):
            arguments = json.dumps(block.input, ensure_ascii=False)
            function = {"name": block.name, "arguments": arguments}
            calls.append({"id": block.id, "type": "function", "function": function})
        elif not isinstance(block, RedactedThinkingBlock):
            raise RequestError(f"a {block.__struct_config__.tag} block belongs in a user message",
                               param=_where(index, j))
    out: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
    if reasoning:
        out["reasoning_content"] = "\n\n".join(reasoning)
    if calls:
        out["tool_calls"] = calls
    return out


def _tool_result(index: int, j: int, block: ToolResultBlock) -> dict[str, Any]:
    content: str | list[dict[str, Any]]
    if isinstance(block.content, str):
        content = f"Error: {block.content}" if block.is_error else block.content
    else:
        content = [_part(index, j, b) for b in block.content]
        if block.is_error:
            content.insert(0, {"type": "text", "text": "Error:"})
    return {"role": "tool", "tool_call_id": block.tool_use_id, "content": content}


def _part(index: int, j: int, block: TextBlock | ImageBlock) -> dict[str, Any]:
    if isinstance(block, TextBlock):
        return {"type": "text", "text": block.text}
    source = block.source
    if isinstance(source, FileSource):
        raise RequestError("image sources of type 'file' (the Files API) are not supported; send the image as "
                           "base64 or a URL", param=_where(index, j))
    url = f"data:{source.media_type};base64,{source.data}" if isinstance(source, Base64Source) else source.url
    return {"type": "image_url", "image_url": {"url": url}}


def _where(index: int, j: int) -> str:
    return f"messages[{index}].content[{j}]"


def _tools(tools: list[Tool] | None) -> list[dict[str, Any]] | None:
    """Custom tools in the OpenAI shape; the others are left out (and logged), not refused: agents send them
    along with their own tools whatever the server."""
    out, dropped = [], []
    for i, tool in enumerate(tools or []):
        if tool.type not in (None, "custom"):
            dropped.append(f"{clip(tool.name)} ({clip(tool.type)})")
            continue
        if tool.input_schema is None:
            raise RequestError(f"tool {clip(tool.name)!r} needs an `input_schema`", param=f"tools[{i}]")
        function: dict[str, Any] = {"name": tool.name}
        if tool.description:
            function["description"] = tool.description
        function["parameters"] = tool.input_schema
        out.append({"type": "function", "function": function})
    if dropped:
        log.info("anthropic_tools_dropped", tools=dropped, reason="defined or run by Anthropic; not in the prompt")
    return out or None


def _tool_choice(body: PromptFields, tools: list[dict[str, Any]] | None) -> tuple[str | dict[str, Any], bool]:
    """The job's ``tool_choice`` and ``parallel_tool_calls``, checked against the custom tools."""
    choice = body.tool_choice
    parallel = not (choice is not None and choice.disable_parallel_tool_use)
    if choice is None or isinstance(choice, ToolChoiceNone):
        return ("none" if choice is not None else "auto"), parallel
    if isinstance(choice, ToolChoiceAny | ToolChoiceTool) and not tools:
        raise RequestError(f"tool_choice {choice.__struct_config__.tag!r} needs at least one custom tool in "
                           "`tools`", param="tool_choice")
    if isinstance(choice, ToolChoiceAny):
        return "required", parallel
    if isinstance(choice, ToolChoiceTool):
        names = [t["function"]["name"] for t in tools or []]
        if choice.name not in names:
            raise RequestError(f"tool_choice names {clip(choice.name)!r}, which is not among the request's custom "
                               f"tools {[clip(n) for n in names][:16]}", param="tool_choice")
        return {"type": "function", "function": {"name": choice.name}}, parallel
    return "auto", parallel


def _template_kwargs(body: PromptFields) -> dict[str, Any]:
    if body.thinking is None:
        return {}
    return {"enable_thinking": not isinstance(body.thinking, ThinkingDisabled)}
