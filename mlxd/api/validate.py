"""Checks that depend on the loaded model and the server's limits, made on the decoded body before any work:

- :func:`check_size`: the message count, and the text every rendered field holds (all messages whatever their
  role, system prompts, tool descriptions and schemas, instructions, input items, template variables), counted
  without rendering or tokenizing, against what the context can hold;
- :func:`check_against_model`: token ids (``top_k``, ``logit_bias`` keys, prompt ids) below the vocabulary size.

The model-independent ranges are ``msgspec.Meta`` constraints in ``mlxd.api.schemas``."""

from __future__ import annotations

from typing import Any

import msgspec

from mlxd.api.schemas import CompletionRequest, SamplingFields
from mlxd.errors import ContextLengthExceeded, RequestError
from mlxd.media.parts import IMAGE_TYPES
from mlxd.pipeline.stage import ModelInfo

# The body fields a prompt is rendered from, on every surface (OpenAI chat and completions, Anthropic messages and
# count_tokens, Responses), in the order they are counted.
RENDERED_FIELDS = ("system", "instructions", "messages", "input", "prompt", "tools", "chat_template_kwargs")
# The most values (strings, numbers, objects, lists) counted per allowed message before the body is refused: the
# count is a walk over the body on the event loop, kept short for any body within max_body_bytes.
VALUES_PER_MESSAGE = 64


def check_size(body: Any, *, max_prompt_bytes: int, context_length: int, max_messages: int) -> None:
    """Refuse (400, naming the field) a body with more than ``max_messages`` messages or input items, or whose
    rendered fields hold more than ``max_prompt_bytes`` of text: then the prompt cannot fit the context whatever
    the template does with it. Image data is not text and is not counted (``[vision]`` bounds it). Each value
    counts one byte more than its text, so that a flood of empty messages or parts is counted too.

    Cheap: no rendering, no tokenizing, and a walk that stops as soon as the bound is passed. Does nothing before
    the model is loaded (``max_prompt_bytes`` 0)."""
    for field in ("messages", "input"):
        items = getattr(body, field, None)
        if isinstance(items, list) and len(items) > max_messages:
            raise RequestError(f"{field} holds {len(items)} items; at most {max_messages} are allowed "
                               "([server] max_messages)", param=field)
    if max_prompt_bytes <= 0:
        return
    max_values, num_bytes, num_values = max_messages * VALUES_PER_MESSAGE, 0, 0
    for field in RENDERED_FIELDS:
        root = getattr(body, field, None)
        if root is None:
            continue
        field_bytes, field_values = _measure(root, max_prompt_bytes - num_bytes, max_values - num_values)
        num_bytes, num_values = num_bytes + field_bytes, num_values + field_values
        if num_bytes > max_prompt_bytes:
            raise ContextLengthExceeded(
                f"the text of the prompt (counted up to {field}) has more than {max_prompt_bytes} bytes: more than the "
                f"{context_length}-token context of this model can hold", param=field)
        if num_values > max_values:
            raise RequestError(f"the request holds more than {max_values} values up to {field} (at most "
                               f"{VALUES_PER_MESSAGE} per allowed message, [server] max_messages)", param=field)


def _measure(root: Any, max_bytes: int, max_values: int) -> tuple[int, int]:
    """Bytes of text (strings, object keys included, plus one per value) and values under ``root``, image parts
    left out; the walk stops once either passes its bound."""
    num_bytes = num_values = 0
    stack = [root]
    while stack and num_bytes <= max_bytes and num_values <= max_values:
        node = stack.pop()
        if node is None:
            continue
        num_values += 1
        num_bytes += 1
        if isinstance(node, str):
            num_bytes += len(node) if node.isascii() else len(node.encode())
        elif isinstance(node, list | tuple):
            stack.extend(node)
        elif isinstance(node, dict):
            if node.get("type") not in IMAGE_TYPES:
                stack.extend(node.keys())
                stack.extend(node.values())
        elif isinstance(node, msgspec.Struct) and not _is_image_struct(node):
            stack.extend(getattr(node, name) for name in node.__struct_fields__)
    return num_bytes, num_values


def _is_image_struct(node: msgspec.Struct) -> bool:
    return type(node).__struct_config__.tag in IMAGE_TYPES or getattr(node, "type", None) in IMAGE_TYPES


def check_against_model(body: SamplingFields, model: ModelInfo | None) -> None:
    """Raise a 400 naming the field when a token id or ``top_k`` is not below the model's vocabulary size.

    Does nothing before the model is loaded or when its vocabulary size is unknown (0)."""
    vocab = model.vocab_size if model is not None else 0
    if vocab <= 0:
        return
    if body.top_k is not None and body.top_k >= vocab:
        raise RequestError(f"top_k must be below the vocabulary size {vocab} (0 is off), got {body.top_k}",
                           param="top_k")
    if body.logit_bias:
        bad = [key for key in body.logit_bias if int(key) >= vocab]
        if bad:
            raise RequestError(f"logit_bias keys must be token ids in [0, {vocab}), got {_ids(bad)}",
                               param="logit_bias")
    if isinstance(body, CompletionRequest) and isinstance(body.prompt, list):
        bad_ids = [token for token in body.prompt if token >= vocab]
        if bad_ids:
            raise RequestError(f"prompt token ids must be in [0, {vocab}), got {_ids(bad_ids)}", param="prompt")


def _ids(values: list[int] | list[str]) -> str:
    shown = ", ".join(str(v) if len(str(v)) <= 24 else str(v)[:24] + "…" for v in values[:5])
    return shown + (f" and {len(values) - 5} more" if len(values) > 5 else "")
