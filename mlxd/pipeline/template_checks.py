"""Size checks for chat-template rendering (:mod:`mlxd.pipeline.template_env`): how large a value an operation
would build, computed from its operands before it runs.

``env`` below is the :class:`~mlxd.pipeline.template_env.BoundedEnvironment`: ``env.check(num_bytes, what)``
raises :class:`TemplateTooLarge` above its bound, ``env.size(value)`` measures a value (:func:`measure`),
``env.text_size(value)`` bounds the length of ``str(value)``.
"""

from __future__ import annotations

import re
import string
from collections.abc import Callable
from typing import Any

# Estimates: a container costs a pointer per item, a new small object about this much; ``str()`` of a non-string
# (a list, a dict) is at most this many times its measured size (quotes, escapes, separators).
OBJECT_BYTES = 64
REPR_FACTOR = 6
# Templates never need big integers; ``**`` and ``*`` on ints are one uninterruptible C call each.
MAX_INT_BITS = 1 << 16
_HUGE = 1 << 62  # a width too long to parse as a number
_LINE_BREAKS = ("\n", "\r", "\x0b", "\x0c", "\x1c", "\x1d", "\x1e", "\x85", "\u2028", "\u2029")
_PERCENT_SPEC = re.compile(r"%(?:\([^)]*\))?[#0\- +]*(\*|\d+)?(?:\.(\*|\d+))?")


class TemplateTooLarge(Exception):  # noqa: N818  (an Exception: Jinja's constant folding defers it to run time)
    """A template operation would build a value larger than the environment's ``max_bytes``."""


def measure(value: Any, limit: int) -> int:
    """Roughly the bytes ``value`` holds, counting shared items each time they appear (what a ``join`` of it
    would build); the walk stops once it passes ``limit``."""
    total, stack = 0, [value]
    while stack and total <= limit:
        item = stack.pop()
        if isinstance(item, str | bytes):
            total += len(item)
        elif isinstance(item, bool | float) or item is None:
            total += 8
        elif isinstance(item, int):
            total += item.bit_length() // 8 + 8
        elif isinstance(item, list | tuple | set | frozenset):
            total += 8 * len(item)
            stack.extend(item)
        elif isinstance(item, dict):
            total += 16 * len(item)
            stack.extend(item.keys())
            stack.extend(item.values())
        else:
            total += OBJECT_BYTES
    return total



def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_power(base: Any, exponent: Any) -> None:
    if is_int(base) and is_int(exponent) and exponent > 0 and abs(base) > 1 \
            and abs(base).bit_length() * exponent > MAX_INT_BITS:
        raise TemplateTooLarge(f"a power above {MAX_INT_BITS} bits")


def percent_estimate(env: Any, fmt: str | bytes, args: Any) -> int:
    """At most how long ``fmt % args`` is: the format, each spec's width and precision, the arguments' text."""
    text = fmt.decode("latin-1") if isinstance(fmt, bytes) else fmt
    widths, specs, star = 0, 0, False
    for match in _PERCENT_SPEC.finditer(text):
        specs += 1
        for group in match.groups():
            if group == "*":
                star = True
            elif group:
                widths += int(group) if len(group) < 19 else _HUGE
    values = args if isinstance(args, tuple) else (args,)
    if star:
        widths += sum(abs(v) for v in values if is_int(v))
    repeats = specs if isinstance(args, dict) else 1  # %(name)s may name one value many times
    return len(text) + widths + repeats * REPR_FACTOR * env.size(args)


def format_estimate(env: Any, fmt: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    """At most how long ``fmt.format(*args, **kwargs)`` is (each field may show any argument)."""
    try:
        fields = list(string.Formatter().parse(fmt))
    except ValueError:
        return len(fmt)  # the call raises the same error
    arguments = REPR_FACTOR * (env.size(args) + env.size(kwargs))
    numbers = sum(abs(v) for v in (*args, *kwargs.values()) if is_int(v))
    total = len(fmt)
    for _, field, spec, _ in fields:
        if field is None:
            continue
        widths = sum(int(d) if len(d) < 19 else _HUGE for d in re.findall(r"\d+", spec or ""))
        total += arguments + widths + (numbers if "{" in (spec or "") else 0)
    return total


# ---- filters: each check takes the filter's arguments (the value first) and returns them, maybe materialized ----


def _center(env: Any, value: Any, width: Any = 80, *args: Any, **kwargs: Any) -> tuple[Any, ...]:
    if is_int(width):
        env.check(max(env.text_size(value), width), "a centred string")
    return (value, width, *args)


def _indent(env: Any, value: Any, width: Any = 4, *args: Any, **kwargs: Any) -> tuple[Any, ...]:
    text = value if isinstance(value, str) else ""
    pad = width if is_int(width) else len(str(width))
    env.check(env.text_size(value) + (sum(text.count(b) for b in _LINE_BREAKS) + 1) * max(pad, 0), "an indent")
    return (value, width, *args)


def _format(env: Any, value: Any, *args: Any, **kwargs: Any) -> tuple[Any, ...]:
    if isinstance(value, str):
        env.check(percent_estimate(env, value, kwargs or args), "a format filter")
    return (value, *args)


def _join(env: Any, value: Any, d: Any = "", *args: Any, **kwargs: Any) -> tuple[Any, ...]:
    items = list(value) if not isinstance(value, str | dict) else value
    if not isinstance(items, str | dict):
        env.check(sum(env.text_size(i) for i in items) + len(str(d)) * len(items), "a join")
    return (items, d, *args)


def _replace(env: Any, value: Any, old: Any = "", new: Any = "", count: Any = None, *args: Any,
             **kwargs: Any) -> tuple[Any, ...]:
    if isinstance(value, str):
        env.check(replace_estimate(value, str(old), str(new), count if is_int(count) else -1), "a replace")
    return (value, old, new, count, *args)


def _batch(env: Any, value: Any, linecount: Any = 1, fill_with: Any = None, *args: Any,
           **kwargs: Any) -> tuple[Any, ...]:
    if fill_with is not None and is_int(linecount):
        env.check(8 * linecount, "a padded batch")
    return (value, linecount, fill_with, *args)


def _slice(env: Any, value: Any, slices: Any = 1, *args: Any, **kwargs: Any) -> tuple[Any, ...]:
    if is_int(slices):
        env.check(OBJECT_BYTES * slices, "slices")
    return (value, slices, *args)


def _list(env: Any, value: Any, *args: Any, **kwargs: Any) -> tuple[Any, ...]:
    if isinstance(value, str | bytes):
        env.check(8 * len(value), "a list of characters")
    return (value, *args)


def _tojson(env: Any, value: Any, *args: Any, **kwargs: Any) -> tuple[Any, ...]:
    indent = kwargs.get("indent", args[1] if len(args) > 1 else None)
    pad = indent if is_int(indent) else len(indent) if isinstance(indent, str) else 0
    size = env.size(value)
    # Each line (at most one per item, items being at least 8 bytes) is indented at most depth times, depth
    # being at most the number of items.
    lines = size // 8 + 1
    env.check(REPR_FACTOR * size + lines * min(lines, 1000) * max(pad, 0), "a tojson")
    return (value, *args)


FILTER_CHECKS: dict[str, Callable[..., tuple[Any, ...]]] = {
    "center": _center, "indent": _indent, "format": _format, "join": _join, "replace": _replace,
    "batch": _batch, "slice": _slice, "list": _list, "tojson": _tojson,
}


# ---- calls of methods ----


def replace_estimate(text: str | bytes, old: Any, new: Any, count: int) -> int:
    try:
        num = text.count(old) if len(old) else len(text) + 1
    except TypeError:
        return len(text)  # the call raises the same error
    if count >= 0:
        num = min(num, count)
    return len(text) + num * max(len(new) - len(old), 0)


def _split_estimate(text: str | bytes, sep: Any = None, maxsplit: Any = -1, **kwargs: Any) -> int:
    sep = kwargs.get("sep", sep)
    maxsplit = kwargs.get("maxsplit", maxsplit)
    try:
        parts = text.count(sep) + 1 if sep else len(text) // 2 + 1
    except TypeError:
        return len(text)
    if is_int(maxsplit) and maxsplit >= 0:
        parts = min(parts, maxsplit + 1)
    return len(text) + parts * OBJECT_BYTES


def _splitlines_estimate(text: str | bytes, *args: Any, **kwargs: Any) -> int:
    breaks = sum(text.count(b) for b in _LINE_BREAKS) if isinstance(text, str) else text.count(b"\n") + \
        text.count(b"\r")
    return len(text) + (breaks + 1) * OBJECT_BYTES


def _width_estimate(text: str | bytes, width: Any = 0, *args: Any, **kwargs: Any) -> int:
    return max(len(text), width if is_int(width) else 0)


def _tabs_estimate(text: str | bytes, tabsize: Any = 8, **kwargs: Any) -> int:
    tabsize = kwargs.get("tabsize", tabsize)
    tab = "\t" if isinstance(text, str) else b"\t"
    return len(text) + text.count(tab) * (tabsize if is_int(tabsize) and tabsize > 0 else 0)


def _translate_estimate(text: str | bytes, table: Any = None, *args: Any, **kwargs: Any) -> int:
    if isinstance(table, dict):
        longest = max((len(v) for v in table.values() if isinstance(v, str | bytes)), default=1)
        return len(text) * max(longest, 1)
    return len(text)


_METHOD_ESTIMATES: dict[str, Callable[..., int]] = {
    "split": _split_estimate, "rsplit": _split_estimate, "splitlines": _splitlines_estimate,
    "center": _width_estimate, "ljust": _width_estimate, "rjust": _width_estimate, "zfill": _width_estimate,
    "expandtabs": _tabs_estimate, "translate": _translate_estimate,
    "replace": lambda text, old="", new="", count=-1, **kw: replace_estimate(
        text, old, new, count if is_int(count) else -1),
    "encode": lambda text, *args, **kwargs: 4 * len(text),
}


def check_call(env: Any, obj: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """Check, before it runs, a call a template makes: string methods that grow text (``replace``, ``join``,
    ``center``, ``split``, ``format``, ...) and ``int.to_bytes``; an integer argument above the bound is refused
    for these. Returns ``args``, with an iterable ``join`` argument materialized."""
    owner, name = getattr(obj, "__self__", None), getattr(obj, "__name__", "")
    wrapped = getattr(obj, "__wrapped__", None)  # the sandbox's str.format wrapper
    if isinstance(getattr(wrapped, "__self__", None), str) and name in ("format", "format_map"):
        values = kwargs if name == "format" else (args[0] if args and isinstance(args[0], dict) else {})
        env.check(format_estimate(env, wrapped.__self__, args if name == "format" else (), values), "a format")
        return args
    if isinstance(owner, str | bytes):
        _check_int_arguments(env, args, kwargs)
        if name == "join" and args:
            items = list(args[0])
            env.check(sum(env.text_size(i) for i in items) + len(owner) * len(items), "a join")
            return (items, *args[1:])
        estimate = _METHOD_ESTIMATES.get(name)
        if estimate is not None:
            env.check(estimate(owner, *args, **kwargs), f"the result of {name}")
    elif is_int(owner) and name == "to_bytes":
        _check_int_arguments(env, args, kwargs)
    return args


def _check_int_arguments(env: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    for value in (*args, *kwargs.values()):
        if is_int(value):
            env.check(value, "an integer argument", charge=False)
