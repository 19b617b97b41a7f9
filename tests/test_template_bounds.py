"""Chat-template rendering (mlxd.pipeline.render): the same text as transformers for real templates, and bounded in
time and size for hostile ones, whoever wrote them (a model's own template, a config's)."""

from __future__ import annotations

import threading
import time
import tracemalloc

import pytest
from mlx_lm.tokenizer_utils import load as load_tokenizer

from mlxd.config.load import convert
from mlxd.errors import RequestError
from mlxd.pipeline.job import Job
from mlxd.pipeline.render import (
    BUDGET_FACTOR,
    TEMPLATE_SWITCHES,
    ChatRenderer,
    RenderBounds,
    TemplateBoundExceeded,
    check_template_switches,
)
from mlxd.pipeline.stage import ModelInfo, PipelineContext
from mlxd.pipeline.stages.template import Template, TemplateConfig
from tests.support import tiny
from tests.support.harmony_template import GPT_OSS_TEMPLATE
from tests.support.tool_templates import NO_TOOLS_TEMPLATE, TOOL_TEMPLATES
from tests.support.vlm_templates import CHATML_TEMPLATE, GEMMA_TEMPLATE, IDEFICS_TEMPLATE, TEMPLATE_HEAD

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city.", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
        "required": ["city"]}}},
    {"type": "function", "function": {"name": "search", "parameters": {
        "type": "object", "properties": {"query": {"type": "string"}}}}},
]
CALL = {"id": "call00001", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
CONVERSATIONS = {
    "one turn": [{"role": "user", "content": "Hello there."}],
    "system and turns": [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Red."}, {"role": "user", "content": "Another."}],
    "tool round": [
        {"role": "system", "content": "You help with weather."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "reasoning_content": "I should call the tool.", "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call00001", "name": "get_weather", "content": '{"temp": 21}'},
        {"role": "assistant", "content": "It is 21 degrees.", "tool_calls": None},
        {"role": "user", "content": "And tomorrow?"}],
}
TEMPLATES = {**TOOL_TEMPLATES, "no_tools": NO_TOOLS_TEMPLATE, "gpt_oss": GPT_OSS_TEMPLATE, "tiny": tiny.CHAT_TEMPLATE,
             "chatml_vl": TEMPLATE_HEAD + CHATML_TEMPLATE, "gemma_vl": TEMPLATE_HEAD + GEMMA_TEMPLATE,
             "idefics_vl": TEMPLATE_HEAD + IDEFICS_TEMPLATE}

LOOPS = ("{% for a in range(99999) %}{% for b in range(99999) %}{% for c in range(99999) %}{% endfor %}"
         "{% endfor %}{% endfor %}")
HOSTILE = {
    "nested loops": LOOPS,
    "a 300 MB repetition": "{% set s = 'a' * 300000000 %}{{ s|length }}",
    "doubling by ~": "{% set ns = namespace(s='a' * 1000) %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}"
                     "{% endfor %}{{ ns.s|length }}",
    "doubling by +": "{% set ns = namespace(s='ab') %}{% for i in range(40) %}{% set ns.s = ns.s + ns.s %}"
                     "{% endfor %}",
    "replace growth": "{% set ns = namespace(s='aaaaaaaaaa') %}{% for i in range(12) %}"
                      "{% set ns.s = ns.s.replace('a', ns.s) %}{% endfor %}",
    "a wide %-format": "{{ '%0999999999d' % 1 }}",
    "a wide format": "{{ '{:>999999999}'.format(1) }}",
    "a wide centre": "{{ 'a'|center(999999999) }}",
    "a wide ljust": "{{ 'a'.ljust(999999999) }}",
    "a join of repeats": "{{ (['x' * 1000000] * 1000)|join }}",
    "a method join": "{{ ''.join(['x' * 1000000] * 1000) }}",
    "a big power": "{{ 9 ** 999999 }}",
    "to_bytes": "{{ (1).to_bytes(999999999, 'big') }}",
    "indent": "{{ ('a\n' * 1000000)|indent(1000) }}",
    "a padded batch": "{{ [1]|batch(999999999, 0)|list }}",
    "tojson indent": "{{ (range(90000)|list)|tojson(indent=100000) }}",
    "output": "{% for i in range(100000) %}{{ 'x' * 10000 }}{% endfor %}",
    "a loop over a filter": "{% for a in range(99999) %}{{ range(99999)|map('string')|join|length }}{% endfor %}",
    "macro loops": "{% macro f() %}{% for a in range(99999) %}{{ a }}{% endfor %}{% endmacro %}"
                   "{% for b in range(99999) %}{% set x = f() %}{% endfor %}",
    "a large value at each level of a recursion": "{% macro f(n) %}{% set s = 'x' * 9000000 %}{{ f(n + 1) if n < 200 }}"
                                                  "{{ s|length }}{% endmacro %}{{ f(0) }}",
    "a set block gathering output": "{% set x %}{% for i in range(99999) %}{{ 'x' * 9000000 }}{% endfor %}"
                                    "{% endset %}{{ x|length }}",
    "a macro gathering output": "{% macro f() %}{% for i in range(99999) %}{{ 'x' * 9000000 }}{% endfor %}"
                                "{% endmacro %}{{ f()|length }}",
    "while via recursion": "{% macro f(n) %}{% for i in range(99999) %}{{ f(n + 1) if n < 3 else '' }}{% endfor %}"
                           "{% endmacro %}{{ f(0) }}",
}
MESSAGES = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return load_tokenizer(tiny_model_dir)


def rendered(tokenizer, template, bounds=None, **kwargs):
    tokenizer.chat_template = template
    return ChatRenderer(tokenizer, bounds or RenderBounds()).render(**kwargs)


def transformers_render(tokenizer, template, **kwargs):
    tokenizer.chat_template = template
    return tokenizer.apply_chat_template(kwargs.pop("messages"), tokenize=False, **kwargs)


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_rendering_equals_transformers(tokenizer, name):
    template, compared = TEMPLATES[name], 0
    for conversation in CONVERSATIONS.values():
        if name.endswith("_vl"):  # vision templates read content parts
            conversation = [{**m, "content": [{"type": "image"}, {"type": "text", "text": m["content"]}]}
                            for m in conversation]
        for tools in (None, TOOLS):
            for switches in ({}, {"enable_thinking": False}, {"reasoning_effort": "high", "thinking": True}):
                for generation_prompt in (True, False):
                    kwargs = dict(messages=conversation, tools=tools, add_generation_prompt=generation_prompt,
                                  **switches)
                    try:
                        expected = transformers_render(tokenizer, template, **kwargs)
                    except Exception as e:  # noqa: BLE001  (the template refuses this conversation: so must we)
                        with pytest.raises(type(e)):
                            rendered(tokenizer, template, **kwargs)
                        continue
                    assert rendered(tokenizer, template, **kwargs) == expected, (name, kwargs)
                    compared += 1
    assert compared >= 12, f"{name}: only {compared} renders to compare"


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_templates_end_fast_with_a_400_and_little_memory(tokenizer, name):
    bounds = RenderBounds(timeout_s=1.0, max_bytes=16 * 1024 * 1024)
    tracemalloc.start()
    started = time.monotonic()
    try:
        with pytest.raises(TemplateBoundExceeded) as raised:
            rendered(tokenizer, HOSTILE[name], bounds, messages=MESSAGES)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert time.monotonic() - started < 3.0
    assert peak < (BUDGET_FACTOR + 1) * bounds.max_bytes, peak
    assert raised.value.status == 400 and raised.value.param == "messages"
    assert "bound" in raised.value.message


def test_the_deadline_interrupts_only_its_own_thread(tokenizer, tiny_model_dir):
    """A render past its deadline ends with a 400 while a neighbour's render, on another thread, is unaffected,
    and the interrupted thread is usable afterwards (no exception left pending)."""
    results = {}

    def neighbour():
        tokenizer_ok = load_tokenizer(tiny_model_dir)
        renderer = ChatRenderer(tokenizer_ok, RenderBounds(timeout_s=5.0))
        results["texts"] = {renderer.render(MESSAGES, add_generation_prompt=True) for _ in range(200)}

    thread = threading.Thread(target=neighbour)
    thread.start()
    with pytest.raises(TemplateBoundExceeded, match="time bound"):
        rendered(tokenizer, LOOPS, RenderBounds(timeout_s=0.3), messages=MESSAGES)
    thread.join(30)
    assert results["texts"] == {"<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"}
    time.sleep(0.1)
    assert sum(range(100000)) == 4999950000  # still running bytecode normally here


def test_a_render_that_finishes_is_never_interrupted_later(tokenizer):
    renderer_text = rendered(tokenizer, tiny.CHAT_TEMPLATE, RenderBounds(timeout_s=1.0), messages=MESSAGES)
    time.sleep(1.5)  # past the deadline: nothing arrives
    assert renderer_text.startswith("<|im_start|>user\nHi")


def test_the_stage_refuses_a_hostile_model_template_with_a_400(tiny_model_dir):
    tokenizer = load_tokenizer(tiny_model_dir)
    tokenizer.chat_template = LOOPS
    stage = Template(convert({}, TemplateConfig, "test"))
    stage.warm_up(PipelineContext(None, ModelInfo("tiny", 256, frozenset(), frozenset()), tokenizer, None))
    stage.renderer.bounds = RenderBounds(timeout_s=0.5)
    started = time.monotonic()
    with pytest.raises(TemplateBoundExceeded, match="time bound"):
        stage.prepare(Job(request_id="h", model="tiny", messages=MESSAGES))
    assert time.monotonic() - started < 2.0


@pytest.mark.parametrize("key", ["chat_template", "tokenize", "tools", "documents", "return_dict", "messages",
                                 "add_generation_prompt", "continue_final_message", "tokenizer_kwargs",
                                 "padding", "bos_token", "x" * 5000])
def test_only_template_switches_are_accepted(key):
    with pytest.raises(RequestError) as raised:
        check_template_switches({key: "x"})
    assert raised.value.param == f"chat_template_kwargs.{key}"[:120]
    assert len(raised.value.message) < 600


@pytest.mark.parametrize("value", [[1], {"a": 1}, "x" * 257])
def test_switch_values_are_small_scalars(value):
    with pytest.raises(RequestError) as raised:
        check_template_switches({"enable_thinking": value})
    assert raised.value.param == "chat_template_kwargs.enable_thinking"


def test_every_switch_with_a_scalar_is_accepted():
    switches = {key: value for key, value in zip(TEMPLATE_SWITCHES, [True, False, "high", 512, None, 1.5, "x" * 256,
                                                                   "mlxd", True], strict=True)}
    assert check_template_switches(switches) == switches
