"""Reasoning parsers (``<think>``, Harmony) and the Harmony tool parser, against oracles.

Each output is fed whole, split in two at every character boundary, and one character at a time: the joined
reasoning, content and tool calls must be the expected ones every time, with no marker in any delta. The gpt-oss
fixture template is rendered with transformers, and the parsers read what it renders.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from mlxd.pipeline.events import ContentDelta, ReasoningDelta, ToolCallDelta
from mlxd.pipeline.parsers.harmony import MARKERS, HarmonyParser, HarmonyReasoningParser
from mlxd.pipeline.parsers.reasoning import (
    REASONING_PARSERS,
    SeedThinkParser,
    ThinkParser,
    detect_reasoning_parser,
)
from tests.support.harmony_template import GPT_OSS_TEMPLATE
from tests.support.tiny import CHAT_TEMPLATE, build_tokenizer

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "location": {"type": "string", "description": "The city, e.g. Paris"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"], "default": "celsius"},
            },
            "required": ["location"],
        },
    },
}
TIME_TOOL = {"type": "function", "function": {"name": "get_time", "parameters": {}}}
TOOLS = [WEATHER_TOOL, TIME_TOOL]

Events = list[ContentDelta | ReasoningDelta | ToolCallDelta]


def splits(text: str) -> Iterator[list[str]]:
    """The text whole, in two pieces at every boundary, and one character at a time."""
    yield [text]
    for at in range(1, len(text)):
        yield [text[:at], text[at:]]
    yield list(text)


def run(parser: Any, pieces: list[str]) -> Events:
    events: Events = []
    for piece in pieces:
        events += parser.feed(piece)
    return events + parser.finish()


def joined(events: Events, markers: tuple[str, ...] = ()) -> tuple[str, str, list[tuple[str, Any]]]:
    """Reasoning, content and calls (name, parsed arguments), checking the shape of every delta on the way."""
    reasoning, content, calls = [], [], []
    for event in events:
        if isinstance(event, ToolCallDelta):
            if event.index == len(calls):  # a call's first delta: id and name, no arguments yet
                assert event.id and event.id.startswith("call_") and event.name and not event.arguments
                calls.append([event.name, ""])
            else:
                assert event.index == len(calls) - 1 and event.id is None and event.name is None
                calls[-1][1] += event.arguments
            continue
        assert event.text, "no empty deltas"
        assert not any(marker in event.text for marker in markers), event
        (reasoning if isinstance(event, ReasoningDelta) else content).append(event.text)
    return "".join(reasoning), "".join(content), [(name, json.loads(args)) for name, args in calls]


def check_all_splits(make: Callable[[], Any], text: str, expected: tuple[str, str, list[Any]]) -> None:
    for pieces in splits(text):
        assert joined(run(make(), pieces), make().special_markers) == expected, pieces


# --- <think> ------------------------------------------------------------------------------------------------

THINK_CASES = [
    # (output, in_reasoning, reasoning, content)
    ("<think>\nLet me add.\n</think>\n\nThe answer is 4.", False, "\nLet me add.\n", "The answer is 4."),
    (" \n<think>a < b</think>b > a", False, "a < b", "b > a"),
    ("<think></think>Answer.", False, "", "Answer."),
    ("<think>a</think>  \n ", False, "a", ""),
    ("<think>unterminated, ends in </thi", False, "unterminated, ends in </thi", ""),
    ("Plain answer: 1 < 2, </thin, <br>.", False, "", "Plain answer: 1 < 2, </thin, <br>."),
    ("<thinking> is not a tag", False, "", "<thinking> is not a tag"),
    ("<thi", False, "", "<thi"),
    ("\n\n", False, "", "\n\n"),
    ("", False, "", ""),
    ("Opened by the prompt.\n</think>\n\nDone.", True, "Opened by the prompt.\n", "Done."),
    ("still thinking <", True, "still thinking <", ""),
    ("</think>Straight to it.", True, "", "Straight to it."),
]


@pytest.mark.parametrize(("text", "in_reasoning", "reasoning", "content"), THINK_CASES)
def test_think_parser_any_split(text: str, in_reasoning: bool, reasoning: str, content: str) -> None:
    check_all_splits(lambda: ThinkParser(in_reasoning=in_reasoning), text, (reasoning, content, []))


def test_think_parser_holds_back_only_possible_markers() -> None:
    parser = ThinkParser()
    assert parser.feed(" <th") == []  # may still open a block
    assert parser.feed("ink>") == []
    assert parser.feed("abc </th") == [ReasoningDelta("abc ")]
    assert parser.feed("ink>\n\n") == []  # whitespace after the block does not begin the content
    assert parser.feed("Answer <") == [ContentDelta("Answer <")]
    assert parser.feed(" <think> later is text") == [ContentDelta(" <think> later is text")]
    assert parser.finish() == []

    plain = ThinkParser()
    assert plain.feed("Hi") == [ContentDelta("Hi")]  # no block: nothing held
    assert plain.feed(" </") == [ContentDelta(" </")]


# --- Harmony ----------------------------------------------------------------------------------------------

ANALYSIS = "<|channel|>analysis<|message|>User wants weather.<|end|>"
CALL_WEATHER = '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
PARIS = '{"location": "Paris"}'

HARMONY_CASES = {
    # id: (output, reasoning, content from HarmonyParser(TOOLS), calls, content from HarmonyReasoningParser)
    "analysis-final": (
        ANALYSIS + "<|start|>assistant<|channel|>final<|message|>It is sunny.<|return|>",
        "User wants weather.", "It is sunny.", [], "It is sunny.",
    ),
    "final-end-stripped": (
        "<|channel|>analysis<|message|>2+2<|end|><|start|>assistant<|channel|>final<|message|>4, i.e. 1 < 5",
        "2+2", "4, i.e. 1 < 5", [], "4, i.e. 1 < 5",
    ),
    "call-constrain": (
        ANALYSIS + CALL_WEATHER + PARIS + "<|call|>",
        "User wants weather.", "", [("get_weather", {"location": "Paris"})], "",
    ),
    "call-recipient-before-channel": (
        ANALYSIS + '<|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>{"tz": "UTC"}<|call|>',
        "User wants weather.", "", [("get_time", {"tz": "UTC"})], "",
    ),
    "call-first-after-generation-prompt": (
        ' to=functions.get_weather<|channel|>commentary json<|message|>{"location": "Oslo"}<|call|>',
        "", "", [("get_weather", {"location": "Oslo"})], "",
    ),
    "call-unterminated-complete": (
        ANALYSIS + CALL_WEATHER + PARIS + "\n",
        "User wants weather.", "", [("get_weather", {"location": "Paris"})], "",
    ),
    "call-unterminated-incomplete": (
        ANALYSIS + CALL_WEATHER + '{"location": "Pa',
        "User wants weather.", '{"location": "Pa', [], "",
    ),
    "call-not-json": (CALL_WEATHER + "Paris<|call|>", "", "Paris", [], ""),
    "call-unknown-name": (
        '<|channel|>commentary to=functions.delete_all <|constrain|>json<|message|>{"all": true}<|call|>',
        "", '{"all": true}', [], "",
    ),
    "call-builtin-tool": ("<|channel|>analysis to=python code<|message|>print(1)<|call|>", "", "print(1)", [], ""),
    "preamble-then-call": (
        "<|channel|>commentary<|message|>Checking the weather.<|end|>" + CALL_WEATHER + "{}<|call|>",
        "", "Checking the weather.", [("get_weather", {})], "Checking the weather.",
    ),
    "two-calls": (
        CALL_WEATHER + PARIS + "<|end|>" + '<|start|>assistant<|channel|>commentary to=functions.get_time'
        ' <|constrain|>json<|message|>{}<|call|>',
        "", "", [("get_weather", {"location": "Paris"}), ("get_time", {})], "",
    ),
    "analysis-unterminated": (
        "<|channel|>analysis<|message|>Still on it: a <| b <", "Still on it: a <| b <", "", [], "",
    ),
    "no-end-before-next-header": (
        "<|channel|>analysis<|message|>a<|start|>assistant<|channel|>final<|message|>b", "a", "b", [], "b",
    ),
    "full-header": ("<|start|>assistant<|channel|>final<|message|>Hi!<|end|>", "", "Hi!", [], "Hi!"),
    "unframed": ("Hello <|there|>, 1 < 2", "", "Hello <|there|>, 1 < 2", [], "Hello <|there|>, 1 < 2"),
    "partial-marker-only": ("<|chan", "", "<|chan", [], "<|chan"),
    "empty": ("", "", "", [], ""),
}


@pytest.mark.parametrize("case", HARMONY_CASES.values(), ids=HARMONY_CASES.keys())
def test_harmony_tool_parser_any_split(case: tuple[str, str, str, list[Any], str]) -> None:
    text, reasoning, content, calls, _ = case
    check_all_splits(lambda: HarmonyParser(TOOLS), text, (reasoning, content, calls))


@pytest.mark.parametrize("case", HARMONY_CASES.values(), ids=HARMONY_CASES.keys())
def test_harmony_reasoning_parser_any_split(case: tuple[str, str, str, list[Any], str]) -> None:
    text, reasoning, _, _, content = case
    check_all_splits(HarmonyReasoningParser, text, (reasoning, content, []))


def test_harmony_without_tools_calls_are_content() -> None:
    text = ANALYSIS + CALL_WEATHER + PARIS + "<|call|>"
    check_all_splits(HarmonyParser, text, ("User wants weather.", PARIS, []))
    check_all_splits(lambda: HarmonyParser([TIME_TOOL]), text, ("User wants weather.", PARIS, []))


def test_harmony_counts_calls_and_gives_each_an_id() -> None:
    parser = HarmonyParser(TOOLS)
    events = run(parser, [HARMONY_CASES["two-calls"][0]])
    assert parser.num_calls == 2
    assert [e.index for e in events] == [0, 0, 1, 1]
    assert events[0].id != events[2].id


def test_harmony_streams_reasoning_and_content_at_once() -> None:
    parser = HarmonyParser(TOOLS)
    assert parser.feed("<|channel|>analysis<|message|>Think") == [ReasoningDelta("Think")]
    assert parser.feed(" more <") == [ReasoningDelta(" more ")]  # "<" may begin a marker
    assert parser.feed("|en") == []
    assert parser.feed("d|><|start|>assistant<|channel|>final<|message|>An") == [ContentDelta("An")]
    assert parser.feed("swer") == [ContentDelta("swer")]
    assert parser.finish() == []


def test_harmony_reasoning_parser_in_reasoning() -> None:
    text = "Opened by the prompt.<|end|><|start|>assistant<|channel|>final<|message|>Done.<|return|>"
    make = lambda: HarmonyReasoningParser(in_reasoning=True)  # noqa: E731
    check_all_splits(make, text, ("Opened by the prompt.", "Done.", []))
    check_all_splits(make, "no end yet", ("no end yet", "", []))


# --- templates: rendering, matching, prompts that open a block ------------------------------------------------

QWEN3_SNIPPET = """{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}
{%- endif %}"""
R1_TEMPLATE = """{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n<think>\\n' }}{%- endif %}"""
CHATML_TEMPLATE = """{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"""
USER = [{"role": "user", "content": "What's the weather in Paris?"}]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from transformers import AutoTokenizer

    folder: Path = tmp_path_factory.mktemp("tokenizer")
    build_tokenizer(folder)
    return AutoTokenizer.from_pretrained(folder)


def render(tokenizer: Any, messages: list[dict[str, Any]], template: str, **kwargs: Any) -> str:
    kwargs.setdefault("add_generation_prompt", True)
    return tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False, **kwargs)


def test_matches_and_detect() -> None:
    assert HarmonyParser.matches(GPT_OSS_TEMPLATE) and HarmonyReasoningParser.matches(GPT_OSS_TEMPLATE)
    assert not ThinkParser.matches(GPT_OSS_TEMPLATE)
    assert detect_reasoning_parser(GPT_OSS_TEMPLATE) is HarmonyReasoningParser
    for template in (QWEN3_SNIPPET, R1_TEMPLATE, CHAT_TEMPLATE):
        assert ThinkParser.matches(template) and not HarmonyReasoningParser.matches(template)
        assert not HarmonyParser.matches(template)
        assert detect_reasoning_parser(template) is ThinkParser
    assert not any(p.matches(CHATML_TEMPLATE) for p in (ThinkParser, HarmonyParser, HarmonyReasoningParser))
    assert detect_reasoning_parser(CHATML_TEMPLATE) is None and detect_reasoning_parser(None) is None
    assert REASONING_PARSERS == {"think": ThinkParser, "seed_oss": SeedThinkParser, "harmony": HarmonyReasoningParser}


def test_opens_in_prompt_on_rendered_prompts(tokenizer: Any) -> None:
    assert ThinkParser.opens_in_prompt(render(tokenizer, USER, R1_TEMPLATE))
    assert not ThinkParser.opens_in_prompt(render(tokenizer, USER, CHAT_TEMPLATE))
    assert not ThinkParser.opens_in_prompt(render(tokenizer, USER, CHAT_TEMPLATE, enable_thinking=False))
    assert not ThinkParser.opens_in_prompt(render(tokenizer, USER, CHATML_TEMPLATE))
    gpt_oss = render(tokenizer, USER, GPT_OSS_TEMPLATE)
    assert not HarmonyReasoningParser.opens_in_prompt(gpt_oss) and not ThinkParser.opens_in_prompt(gpt_oss)
    assert HarmonyReasoningParser.opens_in_prompt(gpt_oss + "<|channel|>analysis<|message|>")


TOOLS_BLOCK = """<|start|>developer<|message|># Instructions\n\nBe brief.\n\n# Tools\n\n## functions\n\n\
namespace functions {\n\n// Get the current weather in a city.\ntype get_weather = (_: {\n// The city, e.g. Paris\n\
location: string,\nunit?: "celsius" | "fahrenheit", // default: celsius,\n}) => any;\n\n\
type get_time = () => any;\n\n} // namespace functions<|end|>"""


def test_gpt_oss_template_renders_system_tools_and_generation_prompt(tokenizer: Any) -> None:
    messages = [{"role": "system", "content": "Be brief."}, *USER]
    prompt = render(tokenizer, messages, GPT_OSS_TEMPLATE, tools=TOOLS, reasoning_effort="high")
    assert prompt.startswith("<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.")
    assert "\nReasoning: high\n\n# Valid channels: analysis, commentary, final." in prompt
    assert "Calls to these tools must go to the commentary channel: 'functions'.<|end|>" in prompt
    assert TOOLS_BLOCK + "<|start|>user<|message|>What's the weather in Paris?<|end|>" in prompt
    assert prompt.endswith("<|end|><|start|>assistant")

    bare = render(tokenizer, USER, GPT_OSS_TEMPLATE)
    assert "Reasoning: medium" in bare and "<|start|>developer" not in bare and "'functions'" not in bare


def test_gpt_oss_template_renders_calls_and_results_the_parser_reads(tokenizer: Any) -> None:
    call = {"type": "function", "function": {"name": "get_weather", "arguments": {"location": "Paris"}}}
    turns = [*USER, {"role": "assistant", "content": "Need the weather.", "tool_calls": [call]},
             {"role": "tool", "content": '{"temperature": 21}'}]
    prompt = render(tokenizer, turns, GPT_OSS_TEMPLATE, tools=TOOLS)
    rendered_call = '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>' + PARIS
    assert prompt.endswith(
        "<|start|>assistant<|channel|>analysis<|message|>Need the weather.<|end|>" + rendered_call + "<|call|>"
        '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"{\\"temperature\\": 21}"<|end|>'
        "<|start|>assistant"
    )
    # What the template renders as a call, the parser reads back as that call.
    history = prompt[prompt.index("<|start|>assistant<|channel|>analysis") : prompt.index("<|call|>") + len("<|call|>")]
    check_all_splits(lambda: HarmonyParser(TOOLS), history,
                     ("Need the weather.", "", [("get_weather", {"location": "Paris"})]))

    # Once a final answer follows, the reasoning before the call is not rendered again.
    answered = render(tokenizer, [*turns, {"role": "assistant", "content": "Sunny, 21 C."}], GPT_OSS_TEMPLATE,
                      tools=TOOLS, add_generation_prompt=False)
    assert "Need the weather." not in answered
    assert answered.endswith("<|start|>assistant<|channel|>final<|message|>Sunny, 21 C.<|return|>")


def test_marker_lists() -> None:
    assert set(HarmonyParser.special_markers) == set(MARKERS) == set(HarmonyReasoningParser.special_markers)
    assert ThinkParser.special_markers == ("<think>", "</think>")
