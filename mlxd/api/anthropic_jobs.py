"""Anthropic Messages request bodies → pipeline jobs: OpenAI-shaped chat messages, tools and switches.

The pipeline speaks the OpenAI chat shape (plain dicts), so a request is translated once, here:

- ``system`` becomes the first, ``system`` message; ``system`` messages in mid-conversation stay where they are
  (``normalize`` decides how the template shows them). Text blocks are concatenated as sent: clients that split
  a system prompt into blocks (for cache breakpoints) write their own separators, as Claude Code does. Claude
  Code's ``x-anthropic-billing-header`` block is left out (``normalize``'s rule, applied to each block): it may
  change with every request and, at the very start of the prompt, would defeat the prefix cache.
- User ``text`` / ``image`` blocks become content parts (an image's base64 source a ``data:`` URI); each
  ``tool_result`` becomes a ``tool`` message answering ``tool_use_id`` (``is_error`` prefixes its content with
  ``Error:``, since chat templates have no place for the flag).
- Assistant ``text`` blocks are joined into ``content``; ``tool_use`` blocks become ``tool_calls`` (arguments: the
  input as JSON); ``thinking`` blocks become ``reasoning_content``, which templates that keep reasoning in the
  current turn's history (Qwen3's) render as the model wrote it; ``redacted_thinking`` is opaque and dropped.
- ``cache_control`` on a text block (system or message) or a tool result is a cache breakpoint where that text
  ends (a marker in the text: :class:`~mlxd.pipeline.stages.template_points.Breakpoints`, located and removed by
  ``template``); on a tool use or thinking block, where the assistant's text so far ends. On a tool it is the end of
  the tool definitions, where ``template`` snapshots every prompt anyway; on an image, not a position of its own.
- Tools Anthropic defines or runs (a ``type`` other than ``custom``) are left out of the prompt and named in a
  log line; ``tool_choice`` ``any`` is ``required``, ``tool`` a named function.
- ``thinking`` ``enabled`` / ``adaptive`` / ``disabled`` sets the template's ``enable_thinking``; absent, the
  template's default stands.

The rules shared with the other surfaces (tool choice, sampling defaults, thinking, stops, the vocabulary check) are
:mod:`mlxd.api.intent`'s; this module parses Anthropic's shapes into their neutral values.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from mlxd.api import intent
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
    ToolChoice,
    ToolChoiceAny,
    ToolChoiceNone,
    ToolChoiceTool,
    ToolResultBlock,
    ToolUseBlock,
)
from mlxd.api.errors import clip
from mlxd.config.schema import SamplingDefaults
from mlxd.errors import RequestError
from mlxd.log import get_logger
from mlxd.pipeline.job import Job
from mlxd.pipeline.stage import ModelInfo
from mlxd.pipeline.stages.normalize import strip_billing_header
from mlxd.pipeline.stages.template_points import Breakpoints

log = get_logger("mlxd.api")

# Anthropic's words for the tools a tool choice may name.
WORDS = intent.Words(tool="custom tool")


def new_message_id() -> str:
    return f"msg_{uuid.uuid4().hex[:24]}"


def messages_job(body: MessagesRequest, model: str, defaults: SamplingDefaults) -> Job:
    """The job of a ``/v1/messages`` request. ``max_tokens`` beyond what the context leaves is clamped (Anthropic
    clients send their model's whole output limit), not refused. Raises ``RequestError`` naming the field."""
    stops = intent.stops(body.stop_sequences, "stop_sequences")
    job = prompt_job(body, model)
    job.max_tokens = body.max_tokens
    job.clamp_max_tokens = True
    job.stop = stops
    job.sampling = intent.sampling(defaults, temperature=body.temperature, top_p=body.top_p, top_k=body.top_k)
    return job


def prompt_job(body: MessagesRequest | CountTokensRequest, model: str) -> Job:
    """A job holding what shapes the prompt (messages, tools, tool choice, thinking switch): enough for
    ``/v1/messages/count_tokens``."""
    intent.check_not_empty(body.messages, "messages")
    if body.messages[-1].role == "assistant":
        raise RequestError("the last message must not be an assistant message: mlxd does not continue (prefill) "
                           "an assistant turn", param="messages")
    choice, tools = intent.resolve_tool_choice(_tool_choice(body.tool_choice), _tools(body.tools), WORDS)
    marks = Breakpoints(new_message_id())
    messages = chat_messages(body, marks)
    return Job(
        request_id=marks.request_id,
        model=model,
        messages=messages,
        cache_breakpoints=tuple(marks.marks),
        tools=tools,
        tool_choice=choice,
        parallel_tool_calls=not (body.tool_choice is not None and body.tool_choice.disable_parallel_tool_use),
        template_kwargs=_template_kwargs(body),
    )


def check_vocabulary(body: MessagesRequest, model: ModelInfo | None) -> None:
    """A 400 when ``top_k`` is not below the model's vocabulary size (unknown before the model loads)."""
    intent.check_vocabulary(model, top_k=body.top_k)


def chat_messages(body: PromptFields, marks: Breakpoints) -> list[dict[str, Any]]:
    """The request's system prompt and messages as OpenAI-shaped chat messages, a marker from ``marks`` where
    each cache breakpoint falls."""
    out = []
    if (system := _system(body.system, marks)) is not None:
        out.append({"role": "system", "content": system})
    for i, message in enumerate(body.messages):
        if message.role == "user":
            out.extend(_user(i, message, marks))
        elif message.role == "assistant":
            out.append(_assistant(i, message, marks))
        else:
            out.append({"role": "system", "content": _system(message.content, marks, i) or ""})
    return out


def _marked(text: str, block: Any, marks: Breakpoints) -> str:
    """``text``, with a breakpoint marker after it when ``block`` asks for one (``cache_control``)."""
    return marks.after(text) if block.cache_control else text


def _system(system: str | list[Any] | None, marks: Breakpoints, index: int = 0) -> str | None:
    """A system prompt's text; ``index`` names a system message in mid-conversation in errors (the top-level
    ``system`` holds text blocks only: its schema checks that)."""
    if isinstance(system, str):
        return system or None
    texts = []
    for j, block in enumerate(system or []):
        if not isinstance(block, TextBlock):
            raise RequestError(f"system messages take text blocks, not {block.__struct_config__.tag}",
                               param=_where(index, j))
        texts.append(_marked(_without_billing_header(block.text), block, marks))
    return "".join(texts) or None


def _without_billing_header(text: str) -> str:
    # A block of its own: the blocks are joined as sent, without a line break, so normalize's rule (which removes
    # the header's line from the start of a system text) is applied to each block before they are joined.
    return strip_billing_header({"role": "system", "content": text})["content"]


def _user(index: int, message: MessageParam, marks: Breakpoints) -> list[dict[str, Any]]:
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
            out.append(_tool_result(index, j, block, marks))
        elif isinstance(block, TextBlock | ImageBlock):
            parts.append(_part(index, j, block, marks))
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


def _assistant(index: int, message: MessageParam, marks: Breakpoints) -> dict[str, Any]:
    if isinstance(message.content, str):
        return {"role": "assistant", "content": message.content}
    texts, reasoning, calls = [], [], []
    for j, block in enumerate(message.content):
        if isinstance(block, TextBlock):
            texts.append(_marked(block.text, block, marks))
        elif isinstance(block, ThinkingBlock):
            reasoning.append(block.thinking)
            texts.append(_marked("", block, marks))
        elif isinstance(block, ToolUseBlock):
            texts.append(_marked("", block, marks))
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


def _tool_result(index: int, j: int, block: ToolResultBlock, marks: Breakpoints) -> dict[str, Any]:
    content: str | list[dict[str, Any]]
    if isinstance(block.content, str):
        content = _marked(f"Error: {block.content}" if block.is_error else block.content, block, marks)
    else:
        content = [_part(index, j, b, marks) for b in block.content]
        if block.is_error:
            content.insert(0, {"type": "text", "text": "Error:"})
        texts = [part for part in content if part["type"] == "text"]
        if texts and block.cache_control:
            texts[-1]["text"] = marks.after(texts[-1]["text"])
    return {"role": "tool", "tool_call_id": block.tool_use_id, "content": content}


def _part(index: int, j: int, block: TextBlock | ImageBlock, marks: Breakpoints) -> dict[str, Any]:
    if isinstance(block, TextBlock):
        return {"type": "text", "text": _marked(block.text, block, marks)}
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


def _tool_choice(choice: ToolChoice | None) -> intent.ToolChoice:
    """``auto`` (the default), ``none``, ``any`` (``required``) or ``tool`` (a named function)."""
    if isinstance(choice, ToolChoiceNone):
        return intent.ToolChoice("none")
    if isinstance(choice, ToolChoiceAny):
        return intent.ToolChoice("required", spelled="any")
    if isinstance(choice, ToolChoiceTool):
        return intent.ToolChoice("named", name=choice.name)
    return intent.ToolChoice("auto")


def _template_kwargs(body: PromptFields) -> dict[str, Any]:
    enabled = None if body.thinking is None else not isinstance(body.thinking, ThinkingDisabled)
    return intent.thinking_switches(enabled=enabled)
