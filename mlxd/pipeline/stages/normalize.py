"""``normalize``: make real agent traffic render with the model's chat template.

- OpenAI ``developer`` role → ``system``; legacy ``function`` role → ``tool``.
- List-of-parts content is joined into text. For a vision model, a message with images keeps its parts: text parts
  and one ``{"type": "image"}`` part where each image was, which the chat template renders as the image's
  placeholder; the images themselves are fetched, checked and decoded here (``mlxd.media``), in prompt order. Image
  parts sent to a text model, and video parts, are refused naming the part.
- Assistant tool-call ``arguments`` given as a JSON string become a dict, for templates that iterate them; for
  templates that only render them as a string (DeepSeek's concatenate them), they stay JSON text (checked).
- Consecutive same-role messages are merged when the template requires alternation.
- A system message in mid-conversation stays in place where the template renders it there; otherwise it
  becomes a clearly marked user turn. It is never moved to the front unless ``hoist_system`` is set, since
  rewriting the start of the prompt defeats prefix caching.
- A system text that starts with Claude Code's ``x-anthropic-billing-header: …`` line loses that line
  (``canonicalize_billing_header``). It carries no instruction, only a fingerprint (``cc_version=2.1.197.c23``)
  that stays the same across the turns of a conversation but changes with its first prompt and with the Claude
  Code version; at the very start of the prompt it would keep conversations that share the whole system prompt
  and tool list from sharing any cached prefix. Removed rather than replaced: a fixed line would cost tokens on
  every request and tell the model nothing.
"""

from __future__ import annotations

import json
import re
from typing import Any, Literal

from mlxd.config.schema import VisionConfig
from mlxd.errors import RequestError
from mlxd.media.parts import find_image_parts, is_image_part, load_images
from mlxd.pipeline.job import Job
from mlxd.pipeline.render import ChatRenderer, render_bounds
from mlxd.pipeline.stage import NoOptions, PipelineContext, Stage

ROLE_ALIASES = {"developer": "system", "function": "tool"}
MID_SYSTEM_PREFIX = "[System message]\n"
BILLING_LINE = re.compile(r"x-anthropic-billing-header:[^\n]*(?:\n+|$)")


class NormalizeConfig(NoOptions, frozen=True):
    merge_consecutive: Literal["auto", "always", "never"] = "auto"
    hoist_system: bool = False
    part_separator: str = "\n"
    canonicalize_billing_header: bool = True


class Normalize(Stage):
    name = "normalize"
    Config = NormalizeConfig
    needs = frozenset({"messages"})
    provides = frozenset({"messages", "images"})

    def __init__(self, config: NormalizeConfig) -> None:
        super().__init__(config)
        self.requires_alternation = config.merge_consecutive == "always"
        self.mid_system_in_place = True
        self.arguments_as_text = False

    def warm_up(self, ctx: PipelineContext) -> None:
        self.accepts_images = ctx.model.kind == "vision"
        self.vision = ctx.config.vision if ctx.config is not None else VisionConfig()
        self.base_dir = ctx.base_dir
        # Tests inject these: a resolver (host → addresses) and hosts exempt from the address checks.
        self.resolver: Any = None
        self.allow_hosts: frozenset[str] = frozenset()
        renderer = ChatRenderer(ctx.tokenizer, render_bounds(ctx.config))
        if self.config.merge_consecutive == "auto":
            self.requires_alternation = not _renders(renderer, _probe_consecutive())
        marker = "MLXD-PROBE-7f3a"
        self.mid_system_in_place = marker in (_render(renderer, _probe_mid_system(marker)) or "")
        self.arguments_as_text = (not _renders(renderer, _probe_tool_call({"x": 1}))
                                  and _renders(renderer, _probe_tool_call('{"x": 1}')))

    def prepare(self, job: Job) -> None:
        if job.messages is None:
            return
        self._take_images(job)
        messages = [self._message(m, job) for m in job.messages]
        if self.config.canonicalize_billing_header:
            messages = [strip_billing_header(m) for m in messages]
        messages = self._place_system(messages)
        if self.requires_alternation:
            messages = merge_consecutive(messages)
        job.messages = messages

    def _message(self, message: dict[str, Any], job: Job) -> dict[str, Any]:
        out = {k: v for k, v in message.items() if v is not None}
        out["role"] = ROLE_ALIASES.get(out["role"], out["role"])
        content = out.get("content")
        if isinstance(content, list):
            if self.accepts_images and any(is_image_part(p) for p in content):
                out["content"] = [_template_part(p) for p in content if is_image_part(p) or _text_of(p) is not None]
            else:
                texts = [_text_of(p) for p in content]
                out["content"] = self.config.part_separator.join(t for t in texts if t is not None)
        elif content is None:
            out["content"] = ""
        if "tool_calls" in out:
            out["tool_calls"] = [_parse_arguments(call, self.arguments_as_text) for call in out["tool_calls"]]
        return out

    def _take_images(self, job: Job) -> None:
        """For a vision model fetch and decode the image parts; for a text model refuse the first one."""
        parts = find_image_parts(job.messages, max_images=self.vision.max_images if self.accepts_images else 1 << 30)
        if parts and not self.accepts_images:
            raise RequestError(f"model {job.model!r} is a text model and does not accept images "
                               f"({len(parts)} image part(s) in the request)", param=parts[0].param)
        # Each with .image (PIL, RGB) and .digest.
        job.images = load_images(parts, config=self.vision, base_dir=self.base_dir, resolver=self.resolver,
                                 allow_hosts=self.allow_hosts)

    def _place_system(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        first_other = next((i for i, m in enumerate(messages) if m["role"] != "system"), len(messages))
        head, rest = messages[:first_other], messages[first_other:]
        if all(m["role"] != "system" for m in rest):
            return messages
        if self.config.hoist_system:
            hoisted = head + [m for m in rest if m["role"] == "system"]
            return merge_consecutive(hoisted) + [m for m in rest if m["role"] != "system"]
        if self.mid_system_in_place:
            return messages
        marked = [
            {"role": "user", "content": MID_SYSTEM_PREFIX + m["content"]} if m["role"] == "system" else m
            for m in rest
        ]
        return head + marked


def _text_of(part: dict[str, Any]) -> str | None:
    return (part.get("text") or "") if part.get("type") in ("text", "input_text") else None


def _template_part(part: dict[str, Any]) -> dict[str, Any]:
    return {"type": "image"} if is_image_part(part) else {"type": "text", "text": _text_of(part)}


def _parse_arguments(call: dict[str, Any], as_text: bool = False) -> dict[str, Any]:
    """The call with its arguments as a dict, or (``as_text``) as compact JSON text; invalid JSON is a 400."""
    function = dict(call.get("function") or {})
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as e:
            raise RequestError(
                f"tool call {function.get('name')!r}: `arguments` is not valid JSON ({e.msg})",
                param="messages",
            ) from e
    function["arguments"] = json.dumps(arguments, ensure_ascii=False) if as_text else arguments
    return {**call, "function": function}


def strip_billing_header(message: dict[str, Any]) -> dict[str, Any]:
    """The message without a leading ``x-anthropic-billing-header:`` line (and the line breaks after it) when it is
    a system message whose text starts with one; any other message is returned as it is."""
    content = message.get("content")
    if message["role"] != "system" or not isinstance(content, str):
        return message
    match = BILLING_LINE.match(content)
    return {**message, "content": content[match.end():]} if match else message


def merge_consecutive(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Merge runs of same-role messages (tool results excepted: each answers its own call)."""
    merged: list[dict[str, Any]] = []
    for message in messages:
        previous = merged[-1] if merged else None
        if previous is None or previous["role"] != message["role"] or message["role"] == "tool":
            merged.append(dict(message))
            continue
        texts = [t for t in (previous.get("content"), message.get("content")) if t]
        previous["content"] = "\n\n".join(texts)
        if message.get("tool_calls"):
            previous["tool_calls"] = previous.get("tool_calls", []) + message["tool_calls"]
    return merged


def _render(renderer: ChatRenderer, messages: list[dict[str, Any]]) -> str | None:
    try:  # bounded in time and size: a model's template may be hostile
        return renderer.render(messages, add_generation_prompt=True)
    except Exception:  # noqa: BLE001 - a template that raises is exactly what the probe detects
        return None


def _renders(renderer: ChatRenderer, messages: list[dict[str, Any]]) -> bool:
    return _render(renderer, messages) is not None


def _probe_consecutive() -> list[dict[str, Any]]:
    return [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]


def _probe_tool_call(arguments: Any) -> list[dict[str, Any]]:
    call = {"id": "call_0", "type": "function", "function": {"name": "f", "arguments": arguments}}
    return [{"role": "user", "content": "a"}, {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_0", "content": "b"}]


def _probe_mid_system(marker: str) -> list[dict[str, Any]]:
    return [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
        {"role": "system", "content": marker},
        {"role": "user", "content": "c"},
    ]
