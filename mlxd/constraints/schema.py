"""JSON-schema preparation shared by structured output and tool calls: the JSON options every grammar is compiled
with, and OpenAI's strict-mode reading of objects that do not say whether they allow more properties."""

from __future__ import annotations

from typing import Any
from urllib.parse import unquote

from mlxd.errors import RequestError

# llguidance's JSON options (its ``x-guidance`` keyword). Separators as json.dumps writes them, which is what chat
# templates render and models learn; no free whitespace, which a model can otherwise emit without end. A schema's
# own ``x-guidance`` may change these, except ``lenient``: an unsupported keyword is always an error, never ignored.
JSON_DEFAULTS: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
JSON_OVERRIDES: dict[str, Any] = {"lenient": False}

# Keywords whose value is a map of names to subschemas, a list of subschemas, or one subschema (``items`` may be a
# list in drafts before 2020-12). ``allOf`` branches are not closed: closing each branch of an intersection would
# forbid the properties the other branches declare.
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems")
_SCHEMA_ONE = ("items", "additionalItems", "additionalProperties", "not", "if", "then", "else", "contains",
               "propertyNames", "unevaluatedProperties", "unevaluatedItems")


def with_json_options(schema: dict[str, Any], *, param: str) -> dict[str, Any]:
    """A shallow copy of ``schema`` whose ``x-guidance`` holds :data:`JSON_DEFAULTS`, then the schema's own
    options, then :data:`JSON_OVERRIDES`. ``RequestError(param=param)`` when ``x-guidance`` is not an object."""
    own = schema.get("x-guidance", {})
    if not isinstance(own, dict):
        raise RequestError(f"x-guidance must be an object of llguidance JSON options, got {own!r}", param=param)
    return {**schema, "x-guidance": {**JSON_DEFAULTS, **own, **JSON_OVERRIDES}}


def close_objects(schema: Any) -> Any:
    """``schema`` with ``additionalProperties: false`` on every object schema that does not set it (a new
    structure; the argument is not changed). This is OpenAI's strict mode, where objects are closed.

    An object schema is one whose ``type`` is or includes ``"object"``, or that lists ``properties``.
    """
    if isinstance(schema, list):
        return [close_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: close_objects(s) for name, s in out[key].items()}
    for key in (*_SCHEMA_LISTS, *_SCHEMA_ONE):
        if key in out:
            out[key] = close_objects(out[key])
    if _is_object_schema(out) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def _is_object_schema(schema: dict[str, Any]) -> bool:
    kind = schema.get("type")
    return kind == "object" or (isinstance(kind, list) and "object" in kind) or "properties" in schema


def find_ref_cycle(schema: Any) -> str | None:
    """A ``$ref`` (or ``allOf`` branch) chain that leads back to where it began, without a character of JSON in
    between, as ``"#/a -> #/b -> #/a"``; ``None`` when there is none. Such a schema (``{"$ref": "#"}``, two
    definitions that refer to each other) has no finite instance, and llguidance only finds out mid-generation."""
    nodes: list[Any] = [schema]
    while nodes:
        node = nodes.pop()
        if isinstance(node, list):
            nodes.extend(node)
        elif isinstance(node, dict):
            if (cycle := _cycle_from(schema, node)) is not None:
                return cycle
            nodes.extend(node.values())
    return None


def _cycle_from(root: Any, start: dict[str, Any]) -> str | None:
    """Depth-first over the edges that consume no input (``$ref``, ``allOf`` branches), from ``start``."""
    stack: list[tuple[Any, tuple[str, ...], frozenset[int]]] = [(start, (), frozenset())]
    while stack:
        node, path, seen = stack.pop()
        if not isinstance(node, dict):
            continue
        if id(node) in seen:
            return " -> ".join(path)
        seen = seen | {id(node)}
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#"):
            stack.append((_resolve(root, ref), (*path, ref), seen))
        branches = node.get("allOf")
        if isinstance(branches, list):
            stack.extend((branch, (*path, f"allOf[{i}]"), seen) for i, branch in enumerate(branches))
        if len(path) > 64:  # a chain this long is not a schema anyone writes; llguidance's own limits apply
            return None
    return None


def _resolve(root: Any, ref: str) -> Any:
    """The subschema a local ``$ref`` (a JSON pointer after ``#``) names, or None."""
    node = root
    for part in ref[1:].split("/")[1:] if ref != "#" else []:
        key = unquote(part).replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict):
            node = node.get(key)
        elif isinstance(node, list) and key.isdigit() and int(key) < len(node):
            node = node[int(key)]
        else:
            return None
    return node
