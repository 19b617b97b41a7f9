"""Request intent: the rules the OpenAI (chat, completions), Anthropic Messages and Responses surfaces share.

Each surface parses its own body into the neutral values these functions take (a :class:`ToolChoice`, a thinking
switch or effort, a format's parts, stops, sampling fields, token ids) and renders its own responses; each rule,
and the 400 it raises, is written once, here. Errors name the request's own field (``param``) and use the
surface's own words (:class:`Words`), so a client reads its API's vocabulary; they are :class:`RequestError`, which
each surface maps to its own error shape.

The rules:

- tool choice: ``auto`` (the default), ``none`` (the template sees no tools), ``required`` or a named function,
  forced ones checked against the request's tools (:func:`resolve_tool_choice`);
- sampling: what the request leaves unset comes from the model's ``[model.sampling]``; penalties default off
  (:func:`sampling`);
- thinking: an effort or an on/off switch becomes the template's ``enable_thinking`` (and ``reasoning_effort``);
  absent, the template's default stands (:func:`thinking_switches`);
- response format: ``text`` is none, ``json_object`` any JSON object, ``json_schema`` needs a schema object
  (:func:`response_format`);
- stops: one string or a list, bounded (:func:`stops`);
- messages (a prompt, input items): not empty (:func:`check_not_empty`);
- vocabulary: ``top_k``, ``logit_bias`` keys and prompt ids below the model's vocabulary (:func:`check_vocabulary`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from mlxd.api.errors import clip
from mlxd.config.schema import SamplingDefaults
from mlxd.engine.base import SamplingParams
from mlxd.errors import RequestError
from mlxd.pipeline.stage import ModelInfo
from mlxd.pipeline.stops import check_stops

ToolMode = Literal["auto", "none", "required", "named"]
# Efforts that turn thinking off, and efforts templates do not know, read as the nearest level they do.
NO_THINKING_EFFORTS = frozenset({"none", "minimal"})
EFFORT_LEVELS = {"minimal": "low", "xhigh": "high"}
# The most tool names an error lists.
NAMES_SHOWN = 16


@dataclass(frozen=True, slots=True)
class Words:
    """How a surface names what the shared rules speak of, so that their errors use the request's own words."""

    tool: str = "tool"  # a tool the template is given: "tool", "custom tool", "function tool"
    format: str = "response_format"  # where the output format is set
    format_schema: str = "json_schema.schema"  # where, inside it, a json_schema format's schema goes
    format_param: str = "response_format"  # the body field an error about the format names


@dataclass(frozen=True, slots=True)
class ToolChoice:
    """A request's tool choice in neutral form: ``mode``, the function ``name`` when ``named``, and how the request
    spelled a forced choice (``'required'``, Anthropic's ``'any'``: for errors)."""

    mode: ToolMode = "auto"
    name: str | None = None
    spelled: str = ""


def plain_tool_choice(choice: Any) -> ToolChoice | None:
    """A tool choice spelled as a bare mode, as both OpenAI surfaces write it (``"auto"``, ``"none"``,
    ``"required"``; absent is ``auto``); ``None`` for any other form, which the surface parses."""
    if choice is None or choice in ("auto", "none", "required"):
        return ToolChoice(choice or "auto")
    return None


def resolve_tool_choice(choice: ToolChoice, tools: list[dict[str, Any]] | None, words: Words = Words()
                        ) -> tuple[str | dict[str, Any], list[dict[str, Any]] | None]:
    """The job's ``tool_choice`` (``"auto"``, ``"none"``, ``"required"`` or ``{"type": "function", "function":
    {"name": ...}}``) and the tools the template sees (chat-shaped; ``None`` for none, or for ``none``).

    A 400 naming ``tool_choice`` when ``required`` comes without tools or a named function is not among them."""
    if choice.mode == "none":
        return "none", None
    if choice.mode == "required" and not tools:
        raise RequestError(f"tool_choice {choice.spelled or 'required'!r} needs at least one {words.tool} in "
                           "`tools`", param="tool_choice")
    if choice.mode == "named":
        names = tool_names(tools)
        if choice.name not in names:
            raise RequestError(f"tool_choice names {clip(str(choice.name))!r}, which is not among the request's "
                               f"{words.tool}s {[clip(n) for n in names][:NAMES_SHOWN]}", param="tool_choice")
        return {"type": "function", "function": {"name": choice.name}}, tools
    return choice.mode, tools or None


def tool_names(tools: list[dict[str, Any]] | None) -> list[str]:
    """The function names of chat-shaped tools, in order."""
    return [tool["function"]["name"] for tool in tools or []]


def sampling(defaults: SamplingDefaults, *, temperature: float | None = None, top_p: float | None = None,
             top_k: int | None = None, min_p: float | None = None, repetition_penalty: float | None = None,
             seed: int | None = None, presence_penalty: float | None = None, frequency_penalty: float | None = None,
             logit_bias: dict[int, float] | None = None) -> SamplingParams:
    """The request's sampling: each value it leaves unset (``None``) is the model's ``[model.sampling]`` default;
    presence and frequency penalties, a seed and a logit bias have none (off). A repetition penalty of 0 is off."""
    return SamplingParams(
        temperature=_or(temperature, defaults.temperature),
        top_p=_or(top_p, defaults.top_p),
        top_k=_or(top_k, defaults.top_k),
        min_p=_or(min_p, defaults.min_p),
        seed=seed,
        presence_penalty=presence_penalty or 0.0,
        frequency_penalty=frequency_penalty or 0.0,
        repetition_penalty=_or(repetition_penalty, defaults.repetition_penalty) or 0.0,
        logit_bias=logit_bias or None,
    )


def _or(value: Any, default: Any) -> Any:
    return default if value is None else value


def thinking_switches(*, effort: str | None = None, enabled: bool | None = None) -> dict[str, Any]:
    """The template variables that carry the request's thinking.

    An ``effort`` (OpenAI ``reasoning_effort``, Responses ``reasoning.effort``) sets ``enable_thinking`` (off for
    ``none`` and ``minimal``) and ``reasoning_effort`` for templates that read it (gpt-oss), as a level they know
    (``minimal`` is ``low``, ``xhigh`` is ``high``). A bare switch (Anthropic ``thinking``: enabled or adaptive is
    on, disabled off; a budget is accepted, not enforced) sets ``enable_thinking`` only. Neither: ``{}``, the
    template's default stands."""
    if effort is not None:
        return {"enable_thinking": effort not in NO_THINKING_EFFORTS,
                "reasoning_effort": EFFORT_LEVELS.get(effort, effort)}
    if enabled is not None:
        return {"enable_thinking": enabled}
    return {}


def response_format(kind: str | None, schema: Any = None, *, strict: bool | None = False, name: str | None = None,
                    words: Words = Words()) -> dict[str, Any] | None:
    """The job's ``response_format``: ``None`` for plain text (absent or ``text``), ``{"type": "json_object"}``, or
    ``{"type": "json_schema", "schema", "strict", "name"}``; a 400 when a ``json_schema`` format has no schema
    object."""
    if kind is None or kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if not isinstance(schema, dict):
        raise RequestError(f"{words.format} json_schema needs `{words.format_schema}`, a JSON schema object",
                           param=words.format_param)
    return {"type": "json_schema", "schema": schema, "strict": bool(strict), "name": name}


def stops(value: str | Sequence[str] | None, param: str) -> list[str]:
    """The request's stop sequences (one string or a list), non-empty ones only; a 400 naming ``param`` past the
    bounds of :func:`mlxd.pipeline.stops.check_stops`."""
    return check_stops([value] if isinstance(value, str) else list(value or []), param)


def check_not_empty(items: Sequence[Any] | str | None, param: str) -> None:
    """A 400 naming ``param`` when the request's messages (or prompt, or input) are empty."""
    if not items:
        raise RequestError(f"`{param}` must not be empty", param=param)


def check_vocabulary(model: ModelInfo | None, *, top_k: int | None = None, logit_bias_ids: Sequence[int] = (),
                     prompt_ids: Sequence[int] = ()) -> None:
    """A 400 naming the field when ``top_k``, a ``logit_bias`` key or a prompt token id is not below the model's
    vocabulary size. Does nothing before the model is loaded or when its vocabulary size is unknown (0)."""
    vocab = model.vocab_size if model is not None else 0
    if vocab <= 0:
        return
    if top_k is not None and top_k >= vocab:
        raise RequestError(f"top_k must be below the vocabulary size {vocab} (0 is off), got {top_k}", param="top_k")
    if bad := [token for token in logit_bias_ids if token >= vocab]:
        raise RequestError(f"logit_bias keys must be token ids in [0, {vocab}), got {_ids(bad)}", param="logit_bias")
    if bad := [token for token in prompt_ids if token >= vocab]:
        raise RequestError(f"prompt token ids must be in [0, {vocab}), got {_ids(bad)}", param="prompt")


def _ids(values: Sequence[int]) -> str:
    shown = ", ".join(str(v) if len(str(v)) <= 24 else str(v)[:24] + "…" for v in values[:5])
    return shown + (f" and {len(values) - 5} more" if len(values) > 5 else "")
