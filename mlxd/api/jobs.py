"""OpenAI request bodies → pipeline jobs: defaults applied, unsupported features refused with a 400."""

from __future__ import annotations

import uuid

import msgspec

from mlxd.api.errors import clip
from mlxd.api.schemas import ChatCompletionRequest, CompletionRequest, SamplingFields
from mlxd.config.schema import SamplingDefaults
from mlxd.engine.base import SamplingParams
from mlxd.errors import RequestError
from mlxd.pipeline.job import Job


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def _check_common(body: SamplingFields) -> None:
    # Ranges are checked when the body is decoded (msgspec.Meta in mlxd.api.schemas); these are features.
    if body.n != 1:
        raise RequestError(f"n={body.n} is not supported; mlxd returns one choice per request", param="n")
    if body.logprobs:
        raise RequestError("logprobs are not supported yet", param="logprobs")


def _sampling(body: SamplingFields, defaults: SamplingDefaults) -> SamplingParams:
    return SamplingParams(
        temperature=defaults.temperature if body.temperature is None else body.temperature,
        top_p=defaults.top_p if body.top_p is None else body.top_p,
        top_k=defaults.top_k if body.top_k is None else body.top_k,
        min_p=defaults.min_p if body.min_p is None else body.min_p,
        seed=body.seed,
        presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        repetition_penalty=body.repetition_penalty or 0.0,
        logit_bias=_logit_bias(body.logit_bias),
    )


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    # Keys are decimal token ids (a pattern in the schema), so int() cannot fail.
    return {int(token): value for token, value in bias.items()} if bias else None


def _stops(stop: str | list[str] | None) -> list[str]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > 16:
        raise RequestError(f"at most 16 stop sequences are allowed, got {len(stops)}", param="stop")
    return [s for s in stops if s]


def chat_job(body: ChatCompletionRequest, model: str, defaults: SamplingDefaults) -> Job:
    _check_common(body)
    if body.response_format is not None and body.response_format.type != "text":
        raise RequestError(
            f"response_format {body.response_format.type!r} is not supported yet; only 'text'",
            param="response_format",
        )
    if not body.messages:
        raise RequestError("`messages` must not be empty", param="messages")
    tools = msgspec.to_builtins(body.tools) if body.tools else None
    if body.tool_choice == "none":
        tools = None
    elif body.tool_choice not in (None, "auto"):
        raise RequestError(
            f"tool_choice {clip(str(body.tool_choice))!r} is not supported yet; use 'auto' or 'none'",
            param="tool_choice",
        )
    limit = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    return Job(
        request_id=new_request_id("chatcmpl"),
        model=model,
        messages=msgspec.to_builtins(body.messages),
        tools=tools,
        template_kwargs=body.chat_template_kwargs or {},
        max_tokens=limit,
        sampling=_sampling(body, defaults),
        stop=_stops(body.stop),
    )


def completion_job(body: CompletionRequest, model: str, defaults: SamplingDefaults) -> Job:
    _check_common(body)
    if body.echo:
        raise RequestError("echo is not supported", param="echo")
    if not body.prompt:
        raise RequestError("`prompt` must not be empty", param="prompt")
    return Job(
        request_id=new_request_id("cmpl"),
        model=model,
        prompt=body.prompt,
        max_tokens=body.max_tokens,
        sampling=_sampling(body, defaults),
        stop=_stops(body.stop),
    )
