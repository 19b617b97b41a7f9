"""Arguments of calls written as markup (``<parameter=p>value</parameter>``, ``<arg_value>``): each value is text,
typed by the tool's JSON schema, and the arguments go out as a JSON object one parameter at a time."""

from __future__ import annotations

import ast
import json
import math
from typing import Any

_BOOLEANS = {"true": True, "false": False}
_NULLS = ("null", "none")


def schema_type(schema: Any) -> str | None:
    """The JSON-schema type of a parameter (the first non-null one of a list), lower-cased; None if not given."""
    kind = schema.get("type") if isinstance(schema, dict) else None
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), None)
    return kind.lower() if isinstance(kind, str) else None


def convert_value(raw: str, schema: Any) -> Any:
    """A parameter's value from its text.

    One leading and one trailing newline (the markup's own) are stripped. A ``string`` parameter keeps the text as
    it is, even when it reads as a number; otherwise text that is valid JSON decodes as JSON, and text that is not
    is converted by the schema's type (``integer``, ``number``, ``boolean``, ``object``, ``array``: Python-style
    literals too, never evaluated), else kept as text.
    """
    text = raw[1:] if raw.startswith("\n") else raw
    text = text[:-1] if text.endswith("\n") else text
    kind = schema_type(schema)
    if kind == "string":
        return text
    try:
        return json.loads(text)
    except ValueError:
        pass
    try:
        return _coerce(text.strip(), kind)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return text


def _coerce(text: str, kind: str | None) -> Any:
    if text.lower() in _NULLS and kind is not None:
        return None
    if kind in ("integer", "number"):
        number = float(text)
        if not math.isfinite(number):  # JSON has no NaN or infinity
            raise ValueError(text)
        return int(number) if kind == "integer" and number.is_integer() else number
    if kind == "boolean":
        return _BOOLEANS[text.lower()] if text.lower() in _BOOLEANS else text
    if kind in ("object", "array"):
        try:
            value = json.loads(text, strict=False)  # raw newlines inside strings
        except ValueError:
            value = ast.literal_eval(text)
        return value if isinstance(value, dict | list) else text
    return text


class TypedArguments:
    """The arguments object of one call, written as JSON text one parameter at a time: ``{"a": 1`` then ``, "b": 2``
    then ``}`` (``{}`` for a call with none)."""

    def __init__(self, tool: dict[str, Any]) -> None:
        parameters = tool.get("parameters")
        properties = parameters.get("properties") if isinstance(parameters, dict) else None
        self._properties = properties if isinstance(properties, dict) else {}
        self.count = 0
        self.closed = False

    def add(self, name: str, raw: str) -> str:
        """The JSON fragment for one parameter, its value typed by its schema."""
        value = convert_value(raw, self._properties.get(name))
        prefix = ", " if self.count else "{"
        self.count += 1
        return f"{prefix}{json.dumps(name, ensure_ascii=False)}: {json.dumps(value, ensure_ascii=False)}"

    def close(self) -> str:
        """The fragment that ends the object (empty once it is closed)."""
        if self.closed:
            return ""
        self.closed = True
        return "}" if self.count else "{}"
