"""Chat-template rendering with a deadline and a size bound, whatever the template.

Jinja's sandbox blocks code and files but not time or memory; a model's own template (or a config's) is rendered
here, in an environment of our own that renders exactly as ``transformers``' ``apply_chat_template(...,
tokenize=False)`` does (same options, filters, globals and inputs) and adds bounds:

- **Size.** Operations whose result size follows from their operands are checked *before* they run: ``*``,
  ``**``, ``+``, ``%`` and ``~``; string methods and filters that take a width, a count or a separator
  (``center``, ``ljust``, ``zfill``, ``replace``, ``join``, ``split``, ``format``, ``indent``, ``tojson(indent)``,
  ``batch``, ...); an integer argument above the bound is refused outright. Other call and filter results are
  measured after they return. The rendered text is counted as it streams. Each is held to ``max_bytes``, and all
  that one render builds (checked values, the output of blocks and macros, the prompt) to ``BUDGET_FACTOR`` times
  that, so deep recursion holding a large value at each level is bounded too.
- **Time.** A watchdog thread delivers :class:`TemplateTimeout` into the rendering thread at the deadline
  (``PyThreadState_SetAsyncExc``): Jinja runs Python bytecode, so any loop shape is interrupted.

A render over either bound is a :class:`TemplateBoundExceeded` (a 400 that says which bound).
"""

from __future__ import annotations

import ctypes
import heapq
import itertools
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import jinja2.meta

from mlxd.errors import RequestError
from mlxd.log import get_logger
from mlxd.pipeline.template_env import BoundedEnvironment, TemplateTooLarge

log = get_logger("mlxd.pipeline")

# The template variables a request may set (``chat_template_kwargs``): switches that real families' templates read.
# Everything else (``chat_template``, ``tools``, ``messages``, the tokenizer's own arguments, special tokens) is
# refused. A switch the model's template does not read is dropped (and logged), which renders the same.
TEMPLATE_SWITCHES: dict[str, str] = {
    "enable_thinking": "Qwen3, GLM-4.5, Hunyuan, SmolLM3: thinking on or off",
    "thinking": "DeepSeek-V3.1, Kimi: thinking on or off",
    "reasoning_effort": "gpt-oss: low, medium or high",
    "thinking_budget": "Seed-OSS: the thinking budget in tokens",
    "use_json_tooldef": "Seed-OSS: tools listed as JSON",
    "tools_in_user_message": "Llama 3.1: tools in the first user message",
    "date_string": "Llama 3.x: the date the system prompt states",
    "model_identity": "gpt-oss: the identity line of the system message",
    "add_vision_id": "Qwen2-VL, Qwen2.5-VL: number the pictures",
}
MAX_SWITCH_BYTES = 256
# All the values and text one render may build, in multiples of ``max_bytes`` (a value may reach ``max_bytes`` alone).
BUDGET_FACTOR = 4
_T = TypeVar("_T")


class TemplateBoundExceeded(RequestError):
    """Rendering the chat template ran past its deadline or built a value or prompt above its size bound."""


class TemplateTimeout(BaseException):  # noqa: N818  (not an Exception: no ``except Exception`` swallows it)
    """Delivered into a rendering thread at its deadline."""


def check_template_switches(kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """``chat_template_kwargs`` from a request, checked: keys among :data:`TEMPLATE_SWITCHES`, values scalars (bool,
    number, null, or a string of at most :data:`MAX_SWITCH_BYTES` bytes). ``RequestError`` names the field
    (``chat_template_kwargs.<key>``)."""
    for key, value in (kwargs or {}).items():
        param = f"chat_template_kwargs.{key}"[:120]
        if key not in TEMPLATE_SWITCHES:
            raise RequestError(f"{key[:64]!r} is not a template switch a request may set; chat_template_kwargs "
                               f"takes {', '.join(TEMPLATE_SWITCHES)}", param=param)
        if not (value is None or isinstance(value, bool | int | float | str)):
            raise RequestError(f"chat_template_kwargs.{key} must be a boolean, number, string or null, "
                               f"not {type(value).__name__}", param=param)
        if isinstance(value, str) and len(value.encode()) > MAX_SWITCH_BYTES:
            raise RequestError(f"chat_template_kwargs.{key} is longer than {MAX_SWITCH_BYTES} bytes", param=param)
    return dict(kwargs or {})


@dataclass(frozen=True, slots=True)
class RenderBounds:
    """How long one render may take (seconds) and how large any value it builds, or its output, may be (bytes)."""

    timeout_s: float = 10.0
    max_bytes: int = 64 * 1024 * 1024


def render_bounds(config: Any) -> RenderBounds:
    """The bounds a daemon config (``[model] template_timeout_s``, ``template_max_bytes``) sets; the defaults
    without one."""
    model = getattr(config, "model", None)
    return RenderBounds(model.template_timeout_s, model.template_max_bytes) if model is not None else RenderBounds()


class ChatRenderer:
    """Renders one tokenizer's chat template(s) within :class:`RenderBounds`; thread-safe.

    ``tokenizer`` is a Hugging Face tokenizer (or mlx-lm's wrapper of one): its ``chat_template`` (a string, or
    named templates picked by ``get_chat_template``) and ``special_tokens_map`` are read as ``transformers`` reads
    them."""

    def __init__(self, tokenizer: Any, bounds: RenderBounds = RenderBounds()) -> None:
        self.tokenizer = tokenizer
        self.bounds = bounds
        self.env = BoundedEnvironment(bounds.max_bytes)
        self._compiled: dict[str, tuple[jinja2.Template, frozenset[str]]] = {}
        self._lock = threading.Lock()

    def variables(self, tools: list[dict[str, Any]] | None = None) -> frozenset[str]:
        """The undeclared variables of the template used with (or without) ``tools``: what it may read."""
        return self._bounded(lambda: self._compile(self._source(tools))[1], time.monotonic())

    def render(self, messages: list[dict[str, Any]], *, tools: list[dict[str, Any]] | None = None,
               add_generation_prompt: bool = False, **kwargs: Any) -> str:
        """The prompt text, as ``tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
        add_generation_prompt=..., **kwargs)`` renders it. ``TemplateBoundExceeded`` past a bound; other
        template errors propagate (Jinja's exceptions, ``TemplateTooLarge`` excepted)."""
        source = self._source(tools)
        variables = {**self.tokenizer.special_tokens_map, **kwargs}
        chat = [_alias_reasoning(_drop_none(m)) for m in messages]
        started = time.monotonic()
        template = self._bounded(lambda: self._compile(source)[0], started)
        return self._bounded(lambda: self._generate(template.generate(
            messages=chat, tools=tools, documents=None, add_generation_prompt=add_generation_prompt,
            **variables)), started)

    def _bounded(self, fn: Callable[[], _T], started: float) -> _T:
        """``fn()`` within what is left of the deadline of a render that began at ``started``."""
        remaining = max(self.bounds.timeout_s - (time.monotonic() - started), 0.0)
        self.env.begin(BUDGET_FACTOR * self.bounds.max_bytes)
        try:
            return run_with_deadline(fn, remaining)
        except TemplateTimeout:
            raise self._refuse(f"the chat template ran past its {self.bounds.timeout_s:g} s time bound",
                               started) from None
        except TemplateTooLarge as e:
            raise self._refuse(f"the chat template exceeded its {self.bounds.max_bytes}-byte size bound ({e})",
                               started) from None

    def _refuse(self, message: str, started: float) -> TemplateBoundExceeded:
        log.warning("template_bound_exceeded", reason=message, seconds=round(time.monotonic() - started, 3))
        return TemplateBoundExceeded(message, param="messages")

    def _source(self, tools: list[dict[str, Any]] | None) -> str:
        return self.tokenizer.get_chat_template(None, tools)

    def _compile(self, source: str) -> tuple[jinja2.Template, frozenset[str]]:
        with self._lock:
            hit = self._compiled.get(source)
        if hit is None:
            hit = (self.env.from_string(source),
                   frozenset(jinja2.meta.find_undeclared_variables(self.env.parse(source))))
            with self._lock:
                self._compiled[source] = hit
        return hit

    def _generate(self, chunks: Iterator[str]) -> str:
        out, size = [], 0
        for chunk in chunks:
            size += len(chunk)
            if size > self.bounds.max_bytes:
                raise TemplateTooLarge(f"the prompt passed {self.bounds.max_bytes} characters")
            out.append(chunk)
        return "".join(out)


def _drop_none(message: dict[str, Any]) -> dict[str, Any]:
    # transformers drops a message's keys whose value is None (templates handle a missing key, not None).
    return {key: value for key, value in message.items() if value is not None}


_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _alias_reasoning(message: dict[str, Any]) -> dict[str, Any]:
    # transformers fills ``reasoning_content`` from older names, and ``thinking`` for gpt-oss templates.
    reasoning = next((message[key] for key in _REASONING_FIELDS if message.get(key) is not None), None)
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


# ---- the deadline ----

def _set_async_exc(thread_id: int, exc: type[BaseException] | None) -> None:
    """Raise ``exc`` in thread ``thread_id`` at its next bytecode; ``None`` withdraws one not raised yet."""
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_id),
                                               ctypes.py_object(exc) if exc is not None else None)


@dataclass(slots=True)
class _Armed:
    thread_id: int
    done: bool = False
    fired: bool = False


class _Watchdog:
    """One daemon thread that interrupts rendering threads whose deadline passed."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._heap: list[tuple[float, int, _Armed]] = []
        self._order = itertools.count()
        self._thread: threading.Thread | None = None

    def arm(self, seconds: float) -> _Armed:
        armed = _Armed(threading.get_ident())
        with self._cond:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="mlxd-template-watchdog", daemon=True)
                self._thread.start()
            heapq.heappush(self._heap, (time.monotonic() + seconds, next(self._order), armed))
            self._cond.notify()
        return armed

    def disarm(self, armed: _Armed) -> None:
        with self._cond:
            armed.done = True
            if armed.fired:  # fired but perhaps not raised yet: take it back, the caller raises instead
                _set_async_exc(armed.thread_id, None)

    def _run(self) -> None:
        with self._cond:
            while True:
                while self._heap and self._heap[0][2].done:
                    heapq.heappop(self._heap)
                if not self._heap:
                    self._cond.wait()
                    continue
                wait = self._heap[0][0] - time.monotonic()
                if wait > 0:
                    self._cond.wait(wait)
                    continue
                armed = heapq.heappop(self._heap)[2]
                armed.fired = True
                _set_async_exc(armed.thread_id, TemplateTimeout)


_WATCHDOG = _Watchdog()


def run_with_deadline(fn: Callable[[], _T], seconds: float) -> _T:
    """``fn()`` in this thread, interrupted by :class:`TemplateTimeout` if it runs past ``seconds``. Only for pure
    Python work with no cleanup of its own to do (the exception may arrive at any bytecode)."""
    armed = _WATCHDOG.arm(seconds)
    try:
        result = fn()
    finally:
        _WATCHDOG.disarm(armed)
    if armed.fired:
        raise TemplateTimeout
    return result
