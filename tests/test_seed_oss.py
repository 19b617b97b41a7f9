"""Seed-OSS: its reasoning (``<seed:think>``) and tool calls (``<seed:tool_call>``), read from what the fixture
template (``tests.support.tool_templates.SEED_OSS_TEMPLATE``, the published template's structure) renders.

Oracles: the assistant turn the template renders for given reasoning, content and calls is generated text that the
two parsers, chained as the ``parse`` stage chains them, read back as that reasoning, content and those calls, fed
whole, split in two at every character and one character at a time; no marker reaches any delta.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from mlxd.pipeline.events import ContentDelta, ReasoningDelta, ToolCallDelta
from mlxd.pipeline.parsers.reasoning import SeedThinkParser, ThinkParser
from mlxd.pipeline.parsers.registry import reasoning_parser_for, tool_parser_for
from mlxd.pipeline.parsers.tools.seed_oss import SeedOssToolParser
from tests.support.tool_templates import QWEN3_CODER_TEMPLATE, SEED_OSS_TEMPLATE

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather for a city.", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                         "metric": {"type": "boolean"}, "hours": {"type": "array"}},
        "required": ["city"]}}},
    {"type": "function", "function": {"name": "search", "description": "Search the web.", "parameters": {
        "type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}},
]
CALLS = [("get_weather", {"city": "Paris", "days": 3, "metric": True, "hours": [9, 12]}),
         ("search", {"query": "umbrella\nprices"})]
USER = [{"role": "user", "content": "What is the weather in Paris?"}]
MARKERS = ("<seed:think>", "</seed:think>", "<seed:tool_call>", "</seed:tool_call>", "<function=", "<parameter=",
           "</parameter>", "</function>", "<seed:eos>")


@pytest.fixture(scope="module")
def hf_tokenizer() -> Any:
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>"))
    return PreTrainedTokenizerFast(tokenizer_object=vocab, bos_token="<s>", eos_token="</s>")


def render(tokenizer: Any, messages: list[dict[str, Any]], generation_prompt: bool, **kwargs: Any) -> str:
    return tokenizer.apply_chat_template(messages, tools=TOOLS, chat_template=SEED_OSS_TEMPLATE, tokenize=False,
                                         add_generation_prompt=generation_prompt, **kwargs)


def generated(tokenizer: Any, message: dict[str, Any]) -> str:
    """What the template renders after the generation prompt for ``message``: the model's output, to its
    ``<seed:eos>``."""
    prompt = render(tokenizer, USER, True)
    whole = render(tokenizer, [*USER, message], False)
    assert whole.startswith(prompt)
    return whole[len(prompt):].split("<seed:eos>")[0]


def splits(text: str) -> Iterator[list[str]]:
    yield [text]
    for at in range(1, len(text)):
        yield [text[:at], text[at:]]
    yield list(text)


def parse(pieces: list[str], in_reasoning: bool = False) -> tuple[str, str, list[tuple[str, Any]]]:
    """Reasoning, content and calls of ``pieces``, through the reasoning parser and then the tool parser."""
    reasoning_parser, tool_parser = SeedThinkParser(in_reasoning=in_reasoning), SeedOssToolParser(TOOLS)
    events: list[Any] = []
    for piece in [*pieces, None]:
        out = reasoning_parser.feed(piece) if piece is not None else reasoning_parser.finish()
        for event in out:
            events += tool_parser.feed(event.text) if isinstance(event, ContentDelta) else [event]
    events += tool_parser.finish()
    reasoning, content, calls = [], [], {}
    for event in events:
        if isinstance(event, ToolCallDelta):
            calls.setdefault(event.index, [event.name, ""])[1] += event.arguments
            continue
        assert event.text and not any(m in event.text for m in MARKERS), event
        (reasoning if isinstance(event, ReasoningDelta) else content).append(event.text)
    return "".join(reasoning), "".join(content), [(n, json.loads(a)) for n, a in calls.values()]


def test_auto_detection_picks_seed_oss_parsers_for_its_template() -> None:
    assert tool_parser_for("auto", SEED_OSS_TEMPLATE) is SeedOssToolParser
    assert reasoning_parser_for("auto", SEED_OSS_TEMPLATE) is SeedThinkParser
    # Qwen3-Coder's template, which shares the <function=...> body, keeps its own parser; <think> is not Seed's.
    assert tool_parser_for("auto", QWEN3_CODER_TEMPLATE).name == "qwen3_coder"
    assert not SeedThinkParser.matches("{{ '<think>' }}") and not ThinkParser.matches(SEED_OSS_TEMPLATE)
    assert tool_parser_for("seed_oss", None) is SeedOssToolParser
    assert reasoning_parser_for("seed_oss", None) is SeedThinkParser


def test_rendered_reasoning_content_and_calls_read_back_at_every_split(hf_tokenizer: Any) -> None:
    message = {"role": "assistant", "reasoning_content": "The user wants <b>weather</b>.", "content": "Let me check.",
               "tool_calls": [{"type": "function", "function": {"name": name, "arguments": args}}
                              for name, args in CALLS]}
    text = generated(hf_tokenizer, message)
    assert text.startswith("<seed:think>The user wants")
    assert "<seed:tool_call>\n<function=get_weather>\n<parameter=city>Paris</parameter>" in text
    for pieces in splits(text):
        assert parse(pieces) == ("The user wants <b>weather</b>.", "Let me check.\n\n", CALLS), pieces


def test_rendered_answer_without_calls_is_reasoning_and_content(hf_tokenizer: Any) -> None:
    text = generated(hf_tokenizer, {"role": "assistant", "reasoning_content": "Easy.", "content": "It is sunny."})
    for pieces in splits(text):
        assert parse(pieces) == ("Easy.", "It is sunny.", []), pieces


SEED_THINK_CASES = [
    # (output, in_reasoning, reasoning, content)
    ("<seed:think>Let me add.</seed:think>\nThe answer is 4.", False, "Let me add.", "The answer is 4."),
    ("<think>not Seed's</think> text", False, "", "<think>not Seed's</think> text"),
    ("<seed:think>cut off </seed:thi", False, "cut off </seed:thi", ""),
    ("Plain <seed: answer", False, "", "Plain <seed: answer"),
    ("Budget is 0, answering.</seed:cot_budget_reflect>\n</seed:think>\n4.", True,
     "Budget is 0, answering.</seed:cot_budget_reflect>\n", "4."),
]


@pytest.mark.parametrize(("text", "in_reasoning", "reasoning", "content"), SEED_THINK_CASES)
def test_seed_think_any_split(text: str, in_reasoning: bool, reasoning: str, content: str) -> None:
    for pieces in splits(text):
        assert parse(pieces, in_reasoning) == (reasoning, content, []), pieces


def test_a_thinking_budget_of_zero_opens_the_block_in_the_prompt(hf_tokenizer: Any) -> None:
    assert SeedThinkParser.opens_in_prompt(render(hf_tokenizer, USER, True, thinking_budget=0))
    assert not SeedThinkParser.opens_in_prompt(render(hf_tokenizer, USER, True))
    assert not SeedThinkParser.opens_in_prompt(render(hf_tokenizer, USER, True, thinking_budget=512))
    closed = render(hf_tokenizer, [*USER, {"role": "assistant", "reasoning_content": "x", "content": "y"}], True)
    assert "<seed:think>x</seed:think>" in closed and not SeedThinkParser.opens_in_prompt(closed)
