"""The Jinja environment chat templates render in (:mod:`mlxd.pipeline.render`): ``transformers``' chat-template
environment (an immutable sandbox with ``trim_blocks``, ``lstrip_blocks``, ``loopcontrols``, the ``generation`` tag,
its ``tojson``, ``raise_exception``, ``strftime_now``, ``dict`` and ``namespace``), less ``lipsum``, with every
operation that can build a large value held to ``max_bytes``.
"""

from __future__ import annotations

import functools
import json
import threading
from collections.abc import Callable
from datetime import datetime
from typing import Any

import jinja2
import jinja2.compiler
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.runtime import str_join
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import _PassArg

from mlxd.pipeline.template_checks import (
    FILTER_CHECKS,
    MAX_INT_BITS,
    OBJECT_BYTES,
    REPR_FACTOR,
    TemplateTooLarge,
    check_call,
    check_power,
    is_int,
    measure,
    percent_estimate,
)

__all__ = ["BoundedEnvironment", "TemplateTooLarge"]


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` (transformers' assistant-mask marker) renders its body."""

    tags = {"generation"}  # noqa: RUF012  (Jinja's extension API)

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.CallBlock:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Callable[[], str]) -> str:
        return caller()


class _Buffer(list):
    """The output a macro, call, filter or ``set`` block gathers before joining it: charged as it grows."""

    __slots__ = ("_env",)

    def __init__(self, env: BoundedEnvironment) -> None:
        super().__init__()
        self._env = env

    def append(self, item: Any) -> None:
        self._env.charge(len(item) if isinstance(item, str) else 0, "a block's output")
        super().append(item)

    def extend(self, items: Any) -> None:
        items = tuple(items)
        self._env.charge(sum(len(i) for i in items if isinstance(i, str)), "a block's output")
        super().extend(items)


class _CodeGenerator(jinja2.compiler.CodeGenerator):
    """``a ~ b`` through :meth:`BoundedEnvironment.concat`, which checks the size first; block output gathered
    in a :class:`_Buffer`."""

    def buffer(self, frame: jinja2.compiler.Frame) -> None:
        frame.buffer = self.temporary_identifier()
        self.writeline(f"{frame.buffer} = environment.new_buffer()")

    def visit_Concat(self, node: jinja2.nodes.Concat, frame: jinja2.compiler.Frame) -> None:  # noqa: N802
        if frame.eval_ctx.volatile or frame.eval_ctx.autoescape:
            super().visit_Concat(node, frame)
            return
        self.write("environment.concat((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:  # noqa: A002  (the name templates pass it by)
    return datetime.now().strftime(format)


class _TemplateDict:
    """``dict(...)`` and ``dict.fromkeys(...)`` without the type's attributes."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


class _Namespace(jinja2.utils.Namespace):
    """A namespace that refuses underscore-prefixed names (as transformers' does)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805  (Jinja's signature: self may be a keyword)
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _Namespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a namespace cannot hold the underscore name {name!r}")


class BoundedEnvironment(ImmutableSandboxedEnvironment):
    """transformers' chat-template environment with sizes held to ``max_bytes`` (see the module docstring)."""

    intercepted_binops = frozenset({"*", "**", "+", "%"})
    code_generator_class = _CodeGenerator

    def __init__(self, max_bytes: int) -> None:
        super().__init__(trim_blocks=True, lstrip_blocks=True,
                         extensions=[_GenerationTag, jinja2.ext.loopcontrols])
        self.max_bytes = max_bytes
        self._render = threading.local()  # the budget left to the render running on this thread
        self.globals.pop("lipsum", None)  # n paragraphs of filler, n chosen by the template
        self.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, dict=_TemplateDict(),
                            namespace=_Namespace)
        self.filters["tojson"] = _tojson
        self.filters = {name: self._bounded_filter(name, f) for name, f in self.filters.items()}

    def begin(self, budget: int) -> None:
        """Start a render on this thread that may build ``budget`` bytes of values and text in all."""
        self._render.left = budget

    def check(self, num_bytes: int, what: str, *, charge: bool = True) -> None:
        """``TemplateTooLarge`` when ``what`` would be ``num_bytes`` bytes, more than ``max_bytes``, or (with
        ``charge``) more than the render's budget has left."""
        if num_bytes > self.max_bytes:
            raise TemplateTooLarge(f"{what} would be about {num_bytes} bytes")
        if charge:
            self.charge(num_bytes, what)

    def charge(self, num_bytes: int, what: str) -> None:
        """Count ``num_bytes`` against this thread's render budget (:meth:`begin`)."""
        left = getattr(self._render, "left", None)
        if left is None:
            return
        self._render.left = left - num_bytes
        if self._render.left < 0:
            raise TemplateTooLarge(f"{what} passes the render's budget of values built")

    def new_buffer(self) -> _Buffer:
        return _Buffer(self)

    def size(self, value: Any) -> int:
        return measure(value, self.max_bytes)

    def text_size(self, value: Any) -> int:
        """Bytes of ``str(value)``, at most."""
        return len(value) if isinstance(value, str) else REPR_FACTOR * self.size(value) + OBJECT_BYTES

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if operator == "**":
            check_power(left, right)
        elif operator == "*":
            self._check_product(left, right)
        elif operator == "+" and isinstance(left, str | bytes | list | tuple):
            self.check(self.size(left) + self.size(right), "a sum")
        elif operator == "%" and isinstance(left, str | bytes):
            self.check(percent_estimate(self, left, right), "a %-format")
        return super().call_binop(context, operator, left, right)

    def _check_product(self, left: Any, right: Any) -> None:
        if is_int(left) and is_int(right):
            if abs(left).bit_length() + abs(right).bit_length() > MAX_INT_BITS:
                raise TemplateTooLarge(f"a product of integers above {MAX_INT_BITS} bits")
            return
        seq, n = (left, right) if is_int(right) else (right, left)
        if is_int(n) and n > 0 and isinstance(seq, str | bytes | list | tuple):
            self.check(n * measure(seq, self.max_bytes // n + 1), "a repetition")

    def concat(self, parts: tuple[Any, ...]) -> str:
        """``a ~ b ~ ...``: their text joined, the size checked first."""
        self.check(sum(self.text_size(p) for p in parts), "a ~ concatenation")
        return str_join(parts)

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        args = check_call(__self, __obj, args, kwargs)
        result = super().call(__context, __obj, *args, **kwargs)
        __self.check(__self.size(result), f"the result of {getattr(__obj, '__name__', 'a call')}")
        return result

    def _bounded_filter(self, name: str, func: Callable[..., Any]) -> Callable[..., Any]:
        check = FILTER_CHECKS.get(name)
        skip = 1 if _PassArg.from_obj(func) is not None else 0

        @functools.wraps(func)
        def bounded(*args: Any, **kwargs: Any) -> Any:
            if check is not None:
                args = (*args[:skip], *check(self, *args[skip:], **kwargs))
            result = func(*args, **kwargs)
            self.check(self.size(result), f"the result of the {name} filter")
            return result

        return bounded
