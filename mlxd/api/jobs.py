"""OpenAI request bodies → pipeline jobs: the body parsed into the neutral values of :mod:`mlxd.api.intent`, whose
rules apply defaults and refuse what cannot be served (400); the OpenAI-only checks (``n``, logprobs, echo) here."""

from __future__ import annotations

import uuid
from typing import Any

import msgspec

from mlxd.api import intent
from mlxd.api.errors import clip
from mlxd.api.schemas import ChatCompletionRequest, CompletionRequest, SamplingFields
from mlxd.config.schema import SamplingDefaults
from mlxd.engine.base import SamplingParams
from mlxd.errors import RequestError
from mlxd.pipeline.job import Job
from mlxd.pipeline.render import check_template_switches
from mlxd.pipeline.stage import ModelInfo
from mlxd.pipeline.stages.template_points import Breakpoints


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def _check_n(body: SamplingFields, max_n: int) -> None:
    # Ranges are checked when the body is decoded (msgspec.Meta in mlxd.api.schemas); this one is the config's.
    if body.n > max_n:
        raise RequestError(f"n={body.n} is more choices than this server allows ([engine] max_n = {max_n})",
                           param="n")


def _sampling(body: SamplingFields, defaults: SamplingDefaults) -> SamplingParams:
    # Keys are decimal token ids (a pattern in the schema), so int() cannot fail.
    bias = {int(token): value for token, value in body.logit_bias.items()} if body.logit_bias else None
    return intent.sampling(defaults, temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
                           min_p=body.min_p, repetition_penalty=body.repetition_penalty, seed=body.seed,
                           presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
                           logit_bias=bias)


def check_vocabulary(body: SamplingFields, model: ModelInfo | None) -> None:
    """A 400 naming the field when ``top_k``, a ``logit_bias`` key or a prompt token id is not below the model's
    vocabulary size (unknown before the model loads)."""
    prompt = body.prompt if isinstance(body, CompletionRequest) and isinstance(body.prompt, list) else ()
    intent.check_vocabulary(model, top_k=body.top_k, logit_bias_ids=[int(key) for key in body.logit_bias or ()],
                            prompt_ids=prompt)


def chat_job(body: ChatCompletionRequest, model: str, defaults: SamplingDefaults, max_n: int = 8) -> Job:
    _check_n(body, max_n)
    intent.check_not_empty(body.messages, "messages")
    tools = msgspec.to_builtins(body.tools) if body.tools else None
    choice, tools = intent.resolve_tool_choice(_tool_choice(body.tool_choice), tools)
    if body.top_logprobs is not None and not body.logprobs:
        raise RequestError("top_logprobs needs logprobs: true", param="top_logprobs")
    limit = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    marks = Breakpoints(new_request_id("chatcmpl"))
    return Job(
        request_id=marks.request_id,
        model=model,
        messages=[_marked(message, marks) for message in msgspec.to_builtins(body.messages)],
        cache_breakpoints=tuple(marks.marks),
        tools=tools,
        template_kwargs=_template_kwargs(body),
        max_tokens=limit,
        sampling=_sampling(body, defaults),
        stop=intent.stops(body.stop, "stop"),
        tool_choice=choice,
        parallel_tool_calls=body.parallel_tool_calls is not False,
        response_format=_response_format(body),
        num_logprobs=(body.top_logprobs or 0) if body.logprobs else None,
        speculative=body.speculative,
        prompt_cache_key=body.prompt_cache_key,
    )


def _marked(message: dict[str, Any], marks: Breakpoints) -> dict[str, Any]:
    """A chat message whose text parts' ``cache_control`` (Anthropic's breakpoints, as routers pass them on in
    OpenAI-shaped bodies) became markers where their text ends (:mod:`mlxd.pipeline.stages.template_points`)."""
    content = message.get("content")
    if not isinstance(content, list) or not any("cache_control" in part for part in content):
        return message
    parts = []
    for part in content:
        part = dict(part)
        if part.pop("cache_control", None) and isinstance(part.get("text"), str):
            part["text"] = marks.after(part["text"])
        parts.append(part)
    return {**message, "content": parts}


def _tool_choice(choice: str | dict[str, Any] | None) -> intent.ToolChoice:
    """``auto`` (the default), ``none``, ``required`` or ``{"type": "function", "function": {"name": ...}}``."""
    if (plain := intent.plain_tool_choice(choice)) is not None:
        return plain
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        return intent.ToolChoice("named", name=choice["function"].get("name"))
    raise RequestError(f"tool_choice must be 'auto', 'none', 'required' or "
                       f"{{'type': 'function', 'function': {{'name': ...}}}}, got {clip(str(choice))!r}",
                       param="tool_choice")


def _response_format(body: ChatCompletionRequest) -> dict[str, Any] | None:
    fmt = body.response_format
    if fmt is None:
        return None
    spec = fmt.json_schema or {}
    return intent.response_format(fmt.type, spec.get("schema"), strict=spec.get("strict", False),
                                  name=spec.get("name"))


def _template_kwargs(body: ChatCompletionRequest) -> dict[str, Any]:
    """The request's template variables: ``reasoning_effort`` as the thinking switch (``enable_thinking``) and the
    effort for templates that read it (gpt-oss). Explicit ``chat_template_kwargs`` win; they are template switches
    only (``mlxd.pipeline.render.TEMPLATE_SWITCHES``), never a template, tools or a tokenizer argument."""
    return {**intent.thinking_switches(effort=body.reasoning_effort),
            **check_template_switches(body.chat_template_kwargs)}


def completion_job(body: CompletionRequest, model: str, defaults: SamplingDefaults, max_n: int = 8) -> Job:
    _check_n(body, max_n)
    if body.echo and body.logprobs is not None:
        raise RequestError("echo with logprobs is not supported: mlxd does not score prompt tokens",
                           param="echo")
    intent.check_not_empty(body.prompt, "prompt")
    return Job(
        request_id=new_request_id("cmpl"),
        model=model,
        prompt=body.prompt,
        max_tokens=body.max_tokens,
        sampling=_sampling(body, defaults),
        stop=intent.stops(body.stop, "stop"),
        num_logprobs=body.logprobs,
        speculative=body.speculative,
    )
