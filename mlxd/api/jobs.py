"""OpenAI request bodies → pipeline jobs: defaults applied, unsupported features refused with a 400."""

from __future__ import annotations

import uuid
from typing import Any

import msgspec

from mlxd.api.errors import clip
from mlxd.api.schemas import ChatCompletionRequest, CompletionRequest, SamplingFields
from mlxd.config.schema import SamplingDefaults
from mlxd.engine.base import SamplingParams
from mlxd.errors import RequestError
from mlxd.pipeline.job import Job
from mlxd.pipeline.render import check_template_switches
from mlxd.pipeline.stops import check_stops


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def _check_n(body: SamplingFields, max_n: int) -> None:
    # Ranges are checked when the body is decoded (msgspec.Meta in mlxd.api.schemas); this one is the config's.
    if body.n > max_n:
        raise RequestError(f"n={body.n} is more choices than this server allows ([engine] max_n = {max_n})",
                           param="n")


def _sampling(body: SamplingFields, defaults: SamplingDefaults) -> SamplingParams:
    return SamplingParams(
        temperature=defaults.temperature if body.temperature is None else body.temperature,
        top_p=defaults.top_p if body.top_p is None else body.top_p,
        top_k=defaults.top_k if body.top_k is None else body.top_k,
        min_p=defaults.min_p if body.min_p is None else body.min_p,
        seed=body.seed,
        presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        repetition_penalty=(defaults.repetition_penalty if body.repetition_penalty is None
                            else body.repetition_penalty) or 0.0,
        logit_bias=_logit_bias(body.logit_bias),
    )


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    # Keys are decimal token ids (a pattern in the schema), so int() cannot fail.
    return {int(token): value for token, value in bias.items()} if bias else None


def _stops(stop: str | list[str] | None) -> list[str]:
    return check_stops([stop] if isinstance(stop, str) else list(stop or []), "stop")


def chat_job(body: ChatCompletionRequest, model: str, defaults: SamplingDefaults, max_n: int = 8) -> Job:
    _check_n(body, max_n)
    if not body.messages:
        raise RequestError("`messages` must not be empty", param="messages")
    tools = msgspec.to_builtins(body.tools) if body.tools else None
    choice = _tool_choice(body.tool_choice, tools)
    if choice == "none":
        tools = None
    if body.top_logprobs is not None and not body.logprobs:
        raise RequestError("top_logprobs needs logprobs: true", param="top_logprobs")
    limit = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    return Job(
        request_id=new_request_id("chatcmpl"),
        model=model,
        messages=msgspec.to_builtins(body.messages),
        tools=tools,
        template_kwargs=_template_kwargs(body),
        max_tokens=limit,
        sampling=_sampling(body, defaults),
        stop=_stops(body.stop),
        tool_choice=choice,
        parallel_tool_calls=body.parallel_tool_calls is not False,
        response_format=_response_format(body),
        num_logprobs=(body.top_logprobs or 0) if body.logprobs else None,
        speculative=body.speculative,
    )


def _tool_choice(choice: str | dict[str, Any] | None, tools: list[dict[str, Any]] | None) -> str | dict[str, Any]:
    """``auto`` (the default), ``none``, ``required`` or a named function, checked against the request's tools."""
    if choice is None or choice in ("auto", "none"):
        return choice or "auto"
    if choice == "required":
        if not tools:
            raise RequestError("tool_choice 'required' needs at least one tool in `tools`", param="tool_choice")
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        names = [t["function"]["name"] for t in tools or []]
        if name not in names:
            raise RequestError(f"tool_choice names {clip(str(name))!r}, which is not among the request's tools "
                               f"{[clip(n) for n in names][:16]}", param="tool_choice")
        return {"type": "function", "function": {"name": name}}
    raise RequestError(f"tool_choice must be 'auto', 'none', 'required' or "
                       f"{{'type': 'function', 'function': {{'name': ...}}}}, got {clip(str(choice))!r}",
                       param="tool_choice")


def _response_format(body: ChatCompletionRequest) -> dict[str, Any] | None:
    fmt = body.response_format
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    spec = fmt.json_schema or {}
    if not isinstance(spec.get("schema"), dict):
        raise RequestError("response_format json_schema needs `json_schema.schema`, a JSON schema object",
                           param="response_format")
    return {"type": "json_schema", "schema": spec["schema"], "strict": bool(spec.get("strict", False)),
            "name": spec.get("name")}


def _template_kwargs(body: ChatCompletionRequest) -> dict[str, Any]:
    """The request's template variables; ``reasoning_effort`` sets the thinking switch (``enable_thinking``) and
    reaches templates that read it (gpt-oss). Explicit ``chat_template_kwargs`` win; they are template switches
    only (``mlxd.pipeline.render.TEMPLATE_SWITCHES``), never a template, tools or a tokenizer argument."""
    kwargs: dict[str, Any] = {}
    if body.reasoning_effort is not None:
        kwargs["enable_thinking"] = body.reasoning_effort not in ("none", "minimal")
        kwargs["reasoning_effort"] = "low" if body.reasoning_effort == "minimal" else body.reasoning_effort
    return {**kwargs, **check_template_switches(body.chat_template_kwargs)}


def completion_job(body: CompletionRequest, model: str, defaults: SamplingDefaults, max_n: int = 8) -> Job:
    _check_n(body, max_n)
    if body.echo and body.logprobs is not None:
        raise RequestError("echo with logprobs is not supported: mlxd does not score prompt tokens",
                           param="echo")
    if not body.prompt:
        raise RequestError("`prompt` must not be empty", param="prompt")
    return Job(
        request_id=new_request_id("cmpl"),
        model=model,
        prompt=body.prompt,
        max_tokens=body.max_tokens,
        sampling=_sampling(body, defaults),
        stop=_stops(body.stop),
        num_logprobs=body.logprobs,
        speculative=body.speculative,
    )
