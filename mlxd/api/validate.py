"""The check that depends on the server's limits, made on the decoded body before any work: :func:`check_size`, the
message count, and the text every rendered field holds (all messages whatever their role, system prompts, tool
descriptions and schemas, instructions, input items, template variables), counted without rendering or tokenizing,
against what the context can hold.

Token ids below the vocabulary size are :func:`mlxd.api.intent.check_vocabulary`'s; the model-independent ranges
are ``msgspec.Meta`` constraints in ``mlxd.api.schemas``."""

from __future__ import annotations

from typing import Any

import msgspec

from mlxd.errors import ContextLengthExceeded, RequestError
from mlxd.media.parts import IMAGE_TYPES

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
