"""JSON-schema preparation shared by structured output and tool calls: the JSON options every grammar is compiled
with, and OpenAI's strict-mode reading of objects that do not say whether they allow more properties."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any
from urllib.parse import unquote

from mlxd.errors import RequestError

# llguidance's JSON options (its ``x-guidance`` keyword). Separators as json.dumps writes them, which is what chat
# templates render and models learn; no free whitespace, which a model can otherwise emit without end. A schema's
# own ``x-guidance`` may change these, except ``lenient``: an unsupported keyword is always an error, never ignored.
JSON_DEFAULTS: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
JSON_OVERRIDES: dict[str, Any] = {"lenient": False}

# Bounds every integer and number of a reply is held to (see :func:`bound_numbers`): 2**63 - 1024 is the largest
# int64 that is also a double below 2**63; 10 digits after the point is the finest multipleOf llguidance compiles.
NUMBER_LIMIT = 2**63 - 1024
FRACTION_DIGITS = 10

# Any JSON value with its numbers bounded: what an object's unlisted properties, an array's unlisted items and an
# empty subschema may hold once bounded (:func:`bound_numbers` adds it to the root's ``$defs``).
ANY_NAME = "mlxd_any_value"
_ANY = {"$ref": f"#/$defs/{ANY_NAME}"}
_ANY_VALUE = {"anyOf": [{"type": "null"}, {"type": "boolean"}, {"type": "string"},
                        {"type": "number", "minimum": -NUMBER_LIMIT, "maximum": NUMBER_LIMIT,
                         "multipleOf": 10.0 ** -FRACTION_DIGITS},
                        {"type": "array", "items": _ANY}, {"type": "object", "additionalProperties": _ANY}]}
# Any JSON object (``response_format: {"type": "json_object"}``).
ANY_JSON_OBJECT: dict[str, Any] = {"type": "object"}
_ANNOTATIONS = frozenset({"title", "description", "default", "examples", "$comment"})

# Keywords whose value is a map of names to subschemas, a list of subschemas, or one subschema (``items`` may be a
# list in drafts before 2020-12). ``allOf`` branches are not closed: closing each branch of an intersection would
# forbid the properties the other branches declare.
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems")
_SCHEMA_ONE = ("items", "additionalItems", "additionalProperties", "not", "if", "then", "else", "contains",
               "propertyNames", "unevaluatedProperties", "unevaluatedItems")


def with_json_options(schema: dict[str, Any], *, param: str) -> dict[str, Any]:
    """A copy of ``schema`` with its numbers bounded (:func:`bound_numbers`) whose ``x-guidance`` holds
    :data:`JSON_DEFAULTS`, then the schema's own options, then :data:`JSON_OVERRIDES`.
    ``RequestError(param=param)`` when ``x-guidance`` is not an object."""
    own = schema.get("x-guidance", {})
    if not isinstance(own, dict):
        raise RequestError(f"x-guidance must be an object of llguidance JSON options, got {own!r}", param=param)
    return {**bound_numbers(schema), "x-guidance": {**JSON_DEFAULTS, **own, **JSON_OVERRIDES}}


def close_objects(schema: Any) -> Any:
    """``schema`` with ``additionalProperties: false`` on every object schema that does not set it (a new
    structure; the argument is not changed). This is OpenAI's strict mode, where objects are closed.

    An object schema is one whose ``type`` is or includes ``"object"``, or that lists ``properties``.
    """
    return _rewrite(schema, _close, _SCHEMA_LISTS, _SCHEMA_ONE)


def _close(schema: dict[str, Any]) -> None:
    if _is_object_schema(schema) and "additionalProperties" not in schema:
        schema["additionalProperties"] = False


def bound_numbers(schema: Any) -> Any:
    """``schema`` with every ``integer`` and ``number`` schema bounded, so that no number in a reply can run on
    without end (a new structure; the argument is not changed). Bounds a schema sets are kept where tighter.

    Integers lie within :data:`NUMBER_LIMIT` (the int64 range less its last 1023 values at each end: llguidance
    reads bounds as doubles, and a bound at 2**63 does not compile). Numbers lie within it too, and without their
    own ``multipleOf`` have at most :data:`FRACTION_DIGITS` digits after the point (llguidance writes a bounded
    number with no exponent), so a number is at most 31 characters. An object's unlisted properties, an array's
    unlisted items and an empty subschema, which allow any value, allow any value with bounded numbers.
    """
    ones = tuple(k for k in _SCHEMA_ONE if k != "not")
    # Not within allOf: llguidance intersects its branches, and intersecting recursive "any" values does not end.
    out = _rewrite(_rewrite(schema, _bound, (*_SCHEMA_LISTS, "allOf"), ones), _fill_any, _SCHEMA_LISTS, ones)
    if isinstance(out, dict) and isinstance(out.get("$defs", {}), dict):
        out["$defs"] = {**out.get("$defs", {}), ANY_NAME: _ANY_VALUE}
    return out


def _fill_any(schema: dict[str, Any]) -> None:
    if "allOf" in schema:
        return
    if set(schema) <= _ANNOTATIONS:
        schema.update(_ANY)
    if _is_object_schema(schema) and schema.get("additionalProperties", True) is True:
        schema["additionalProperties"] = _ANY
    if _is_array_schema(schema) and schema.get("items", True) is True and "prefixItems" not in schema:
        schema["items"] = _ANY


def _bound(schema: dict[str, Any]) -> None:
    kind = schema.get("type")
    kinds = kind if isinstance(kind, list) else [kind]
    if "integer" not in kinds and "number" not in kinds:
        return
    schema["minimum"] = _tighter(schema.get("minimum"), -NUMBER_LIMIT, max)
    schema["maximum"] = _tighter(schema.get("maximum"), NUMBER_LIMIT, min)
    if "number" in kinds and "multipleOf" not in schema:
        schema["multipleOf"] = 10.0 ** -FRACTION_DIGITS


def _is_array_schema(schema: dict[str, Any]) -> bool:
    kind = schema.get("type")
    return kind == "array" or (isinstance(kind, list) and "array" in kind)


def _tighter(own: Any, limit: int, pick: Callable[[Any, Any], Any]) -> Any:
    """The schema's own bound where it is tighter than ``limit``; a bound that is not a number is left for
    llguidance to refuse."""
    if isinstance(own, bool) or not isinstance(own, (int, float)):
        return limit if own is None else own
    return pick(own, limit)


def _rewrite(schema: Any, fix: Callable[[dict[str, Any]], None], lists: tuple[str, ...],
             ones: tuple[str, ...]) -> Any:
    """A copy of ``schema`` with ``fix`` applied (in place, on the copy) to every subschema reached through
    :data:`_SCHEMA_MAPS`, ``lists`` and ``ones``, innermost first."""
    if isinstance(schema, list):
        return [_rewrite(s, fix, lists, ones) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: _rewrite(s, fix, lists, ones) for name, s in out[key].items()}
    for key in (*lists, *ones):
        if key in out:
            out[key] = _rewrite(out[key], fix, lists, ones)
    fix(out)
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
