"""Streaming tool-call parsers (``mlxd.pipeline.parsers.tools``).

Oracles: the same text fed whole, split in two at every character boundary, and character by character gives the
same calls and the same content; markup never reaches content; and each family's published chat template (the
fixtures of ``tests.support.tool_templates``) renders calls that the family's parser reads back as the same calls.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from mlxd.pipeline.events import ContentDelta, ToolCallDelta
from mlxd.pipeline.parsers.tools import TOOL_PARSERS, detect_tool_parser
from mlxd.pipeline.parsers.tools.deepseek import CALL_BEGIN, CALL_END, CALLS_BEGIN, CALLS_END, SEP
from tests.support.tool_templates import EXPECTED_PARSER, NO_TOOLS_TEMPLATE, TOOL_TEMPLATES


def _tool(name: str, **types: Any) -> dict[str, Any]:
    properties = {key: {"type": kind} for key, kind in types.items()}
    return {"type": "function", "function": {"name": name, "parameters": {"type": "object", "properties": properties}}}


TOOLS = [_tool("get_weather", city="string", days="integer"), _tool("get_time", timezone="string")]
# Braces, escaped quotes and a final backslash in a string value: only a parser that counts brackets outside
# strings, escapes included, finds where the value ends.
WEATHER = ("get_weather", {"city": 'Pa}ris "{x" \\', "days": 3})
TIME = ("get_time", {"timezone": "Europe/Paris"})
UNKNOWN = ("launch_rocket", {"target": "moon"})
BEFORE = "Let me check.\n"


# -- model output in each format


def hermes(call: tuple[str, dict], args_first: bool = False) -> str:
    name, args = call
    body = f'"arguments": {json.dumps(args)}, "name": "{name}"' if args_first else \
        f'"name": "{name}", "arguments": {json.dumps(args)}'
    return f"<tool_call>\n{{{body}}}\n</tool_call>"


def qwen3_coder(call: tuple[str, dict]) -> str:
    params = "".join(f"<parameter={key}>\n{value}\n</parameter>\n" for key, value in call[1].items())
    return f"<tool_call>\n<function={call[0]}>\n{params}</function>\n</tool_call>"


def seed_oss(call: tuple[str, dict]) -> str:
    params = "".join(f"<parameter={key}>{value}</parameter>\n" for key, value in call[1].items())
    return f"<seed:tool_call>\n<function={call[0]}>\n{params}</function>\n</seed:tool_call>"


def llama3(call: tuple[str, dict]) -> str:
    return f'{{"name": "{call[0]}", "parameters": {json.dumps(call[1])}}}'


def mistral(call: tuple[str, dict]) -> str:
    return f"[TOOL_CALLS]{call[0]}[ARGS]{json.dumps(call[1])}"


def mistral_item(call: tuple[str, dict]) -> str:
    return json.dumps({"name": call[0], "arguments": call[1]})


def deepseek_v3(call: tuple[str, dict]) -> str:
    return f"{CALL_BEGIN}function{SEP}{call[0]}\n```json\n{json.dumps(call[1])}\n```{CALL_END}"


def deepseek_v31(call: tuple[str, dict]) -> str:
    return f"{CALL_BEGIN}{call[0]}{SEP}{json.dumps(call[1])}{CALL_END}"


def glm45(call: tuple[str, dict], sep: str = "\n") -> str:
    pairs = "".join(f"<arg_key>{k}</arg_key>{sep}<arg_value>{v}</arg_value>{sep}" for k, v in call[1].items())
    return f"<tool_call>{call[0]}{sep}{pairs}</tool_call>"


def pythonic(call: tuple[str, dict]) -> str:
    return f"{call[0]}(" + ", ".join(f"{k}={v!r}" for k, v in call[1].items()) + ")"


@dataclass
class Case:
    id: str
    parser: str
    one: str  # content, then one call (WEATHER)
    two: str  # two calls in a row (WEATHER, TIME)
    content: str  # the content of ``one``
    markup: tuple[str, ...]  # text that must never reach content

    def variants(self) -> list[tuple[str, str, list]]:
        return [(self.one, self.content, [WEATHER]), (self.two, "", [WEATHER, TIME])]


DS_MARKUP = (CALLS_BEGIN, CALL_BEGIN, SEP, CALL_END, CALLS_END, "```", "function")
CASES = [
    Case("hermes", "hermes", BEFORE + hermes(WEATHER), hermes(WEATHER) + "\n" + hermes(TIME), BEFORE,
         ("<tool_call>", "</tool_call>", '"name"')),
    Case("hermes-arguments-first", "hermes", BEFORE + hermes(WEATHER, True),
         hermes(WEATHER, True) + "\n" + hermes(TIME, True), BEFORE, ("<tool_call>", "</tool_call>", '"name"')),
    Case("qwen3_coder", "qwen3_coder", BEFORE + qwen3_coder(WEATHER), qwen3_coder(WEATHER) + "\n" + qwen3_coder(TIME),
         BEFORE, ("<tool_call>", "<function=", "<parameter=", "</parameter>", "</function>", "</tool_call>")),
    Case("seed_oss", "seed_oss", BEFORE + seed_oss(WEATHER), seed_oss(WEATHER) + "\n" + seed_oss(TIME), BEFORE,
         ("<seed:tool_call>", "<function=", "<parameter=", "</parameter>", "</function>", "</seed:tool_call>")),
    Case("llama3", "llama3", llama3(WEATHER), llama3(WEATHER) + "; " + llama3(TIME), "", ('"name"', '"parameters"')),
    Case("llama3-python-tag", "llama3", "<|python_tag|>" + llama3(WEATHER),
         "<|python_tag|>" + llama3(WEATHER) + ";" + llama3(TIME), "", ("<|python_tag|>", '"name"')),
    Case("mistral", "mistral", "Let me check. " + mistral(WEATHER), mistral(WEATHER) + mistral(TIME),
         "Let me check. ", ("[TOOL_CALLS]", "[ARGS]", "get_weather")),
    Case("mistral-list", "mistral", f"Let me check.[TOOL_CALLS][{mistral_item(WEATHER)}]",
         f"[TOOL_CALLS][{mistral_item(WEATHER)}, {mistral_item(TIME)}]", "Let me check.",
         ("[TOOL_CALLS]", '"name"', "]")),
    Case("deepseek-v3", "deepseek", f"Let me check.{CALLS_BEGIN}{deepseek_v3(WEATHER)}{CALLS_END}",
         f"{CALLS_BEGIN}{deepseek_v3(WEATHER)}\n{deepseek_v3(TIME)}{CALLS_END}", "Let me check.", DS_MARKUP),
    Case("deepseek-v3.1", "deepseek", f"Let me check.{CALLS_BEGIN}{deepseek_v31(WEATHER)}{CALLS_END}",
         f"{CALLS_BEGIN}{deepseek_v31(WEATHER)}{deepseek_v31(TIME)}{CALLS_END}", "Let me check.", DS_MARKUP),
    Case("glm45", "glm45", BEFORE + glm45(WEATHER), glm45(WEATHER) + "\n" + glm45(TIME), BEFORE,
         ("<tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>", "</tool_call>")),
    Case("glm47", "glm45", "Let me check." + glm45(WEATHER, ""), glm45(WEATHER, "") + glm45(TIME, ""),
         "Let me check.", ("<tool_call>", "<arg_key>", "<arg_value>", "</tool_call>")),
    Case("pythonic", "pythonic", f"[{pythonic(WEATHER)}]", f"[{pythonic(WEATHER)}, {pythonic(TIME)}]", "",
         ("get_weather(", "[", "]")),
    Case("pythonic-tagged", "pythonic", f"Let me check.<|python_start|>[{pythonic(WEATHER)}]<|python_end|>",
         f"<|python_start|>[{pythonic(WEATHER)}, {pythonic(TIME)}]<|python_end|>", "Let me check.",
         ("<|python_start|>", "<|python_end|>", "get_weather(")),
    Case("generic", "generic", f"{BEFORE}```json\n{mistral_item(WEATHER)}\n```",
         f"{mistral_item(WEATHER)}\n<tool_call>{mistral_item(TIME)}</tool_call>", BEFORE,
         ('"name"', "```", "<tool_call>", "</tool_call>")),
]


# -- driving a parser


def run(parser_name: str, pieces: list[str], tools: list | None = TOOLS) -> tuple[Any, list]:
    parser = TOOL_PARSERS[parser_name](tools)
    events = [event for piece in pieces for event in parser.feed(piece)]
    return parser, events + parser.finish()


def summarize(events: list) -> tuple[str, list[tuple[str, Any]], list[str]]:
    """Joined content, the calls (name, arguments decoded), the content deltas; checks the deltas' shape."""
    texts: list[str] = []
    calls: dict[int, list[str]] = {}
    for event in events:
        if isinstance(event, ContentDelta):
            texts.append(event.text)
            continue
        assert isinstance(event, ToolCallDelta)
        if event.index not in calls:
            assert event.index == len(calls), "calls are numbered in order"
            assert event.id and event.id.startswith("call_") and event.name, event
            calls[event.index] = [event.name, event.arguments]
        else:
            assert event.id is None and event.name is None, event
            calls[event.index][1] += event.arguments
    return "".join(texts), [(name, json.loads(args)) for name, args in calls.values()], texts


def splits(text: str) -> Iterator[list[str]]:
    yield [text]
    for i in range(1, len(text)):
        yield [text[:i], text[i:]]
    yield list(text)


# -- every format, every split


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.id)
def test_every_split_gives_the_same_calls_and_content(case: Case) -> None:
    for text, content, calls in case.variants():
        for pieces in splits(text):
            parser, events = run(case.parser, pieces)
            got_content, got_calls, deltas = summarize(events)
            assert got_calls == calls, pieces
            assert got_content == content, pieces
            assert parser.num_calls == len(calls)
            for delta in [*deltas, got_content]:
                assert not [m for m in case.markup if m in delta], (pieces, delta)


# Formats whose arguments arrive only with the end of their call: Python calls, JSON objects not written name-first.
WHOLE_ARGUMENTS = {"pythonic", "pythonic-tagged", "hermes-arguments-first"}


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.id)
def test_first_delta_has_id_and_name_then_arguments_stream(case: Case) -> None:
    for pieces in ([case.two], list(case.two)):
        deltas = [e for e in run(case.parser, pieces)[1] if isinstance(e, ToolCallDelta)]
        for index, (name, args) in enumerate([WEATHER, TIME]):
            mine = [e for e in deltas if e.index == index]
            assert (mine[0].name, bool(mine[0].id)) == (name, True)
            joined = "".join(e.arguments for e in mine)
            assert json.loads(joined) == args and joined.startswith(mine[0].arguments)
            if len(pieces) > 1 and case.id not in WHOLE_ARGUMENTS:
                assert len([e for e in mine if e.arguments]) > 1, "arguments go out as they are generated"


def test_json_arguments_stream_before_the_call_ends() -> None:
    text = hermes(WEATHER)
    parser = TOOL_PARSERS["hermes"](TOOLS)
    events = parser.feed(text[:text.index('"days"')])
    assert events[0].name == "get_weather" and events[0].id
    assert "".join(e.arguments for e in events) == json.dumps(WEATHER[1])[:-len('"days": 3}')]


@pytest.mark.parametrize("parser_name", sorted(TOOL_PARSERS))
def test_plain_text_goes_out_at_once(parser_name: str) -> None:
    parser = TOOL_PARSERS[parser_name](TOOLS)
    assert parser.feed("The answer is 42.") == [ContentDelta("The answer is 42.")]
    assert parser.feed(" Done.") == [ContentDelta(" Done.")]
    assert parser.finish() == [] and parser.num_calls == 0


HELD = [("hermes", "<tool_c"), ("qwen3_coder", "<tool"), ("seed_oss", "<seed:tool_"), ("glm45", "<"), ("mistral", "[TOOL_CA"),
        ("deepseek", "<｜tool▁ca"), ("pythonic", "<|python_st"), ("generic", "```js")]


@pytest.mark.parametrize(("parser_name", "held"), HELD)
def test_only_a_possible_marker_start_is_held_back(parser_name: str, held: str) -> None:
    parser = TOOL_PARSERS[parser_name](TOOLS)
    assert parser.feed("Look " + held) == [ContentDelta("Look ")]
    assert parser.finish() == [ContentDelta(held)]


@pytest.mark.parametrize("parser_name", ["llama3", "pythonic"])
def test_calls_after_content_are_content_for_whole_message_formats(parser_name: str) -> None:
    text = "Sure: " + (llama3(WEATHER) if parser_name == "llama3" else f"[{pythonic(WEATHER)}]")
    for pieces in splits(text):
        content, calls, _ = summarize(run(parser_name, pieces)[1])
        assert (content, calls) == (text, [])


@pytest.mark.parametrize("parser_name", sorted(TOOL_PARSERS))
def test_without_tools_everything_is_content(parser_name: str) -> None:
    case = next(case for case in CASES if case.parser == parser_name)
    content, calls, _ = summarize(run(parser_name, list(case.two), tools=None)[1])
    assert (content, calls) == (case.two, [])


# -- calls that are not calls, and the end of the stream

UNKNOWN_CALLS = [
    ("hermes", BEFORE + hermes(UNKNOWN) + "\nDone."),
    ("qwen3_coder", BEFORE + qwen3_coder(UNKNOWN)),
    ("seed_oss", BEFORE + seed_oss(UNKNOWN)),
    ("seed_oss", BEFORE + qwen3_coder(WEATHER)),  # Qwen3-Coder's markers are text in Seed-OSS output
    ("llama3", llama3(UNKNOWN)),
    ("mistral", mistral(UNKNOWN)),
    ("mistral", f"[TOOL_CALLS][{mistral_item(UNKNOWN)}]"),
    ("deepseek", f"{CALL_BEGIN}{UNKNOWN[0]}{SEP}{json.dumps(UNKNOWN[1])}{CALL_END}"),
    ("glm45", BEFORE + glm45(UNKNOWN)),
    ("pythonic", f"[{pythonic(UNKNOWN)}]"),
    ("generic", f"{BEFORE}```json\n{mistral_item(UNKNOWN)}\n``` and {mistral_item(UNKNOWN)}"),
]


@pytest.mark.parametrize(("parser_name", "text"), UNKNOWN_CALLS)
def test_a_call_to_an_unknown_tool_is_content(parser_name: str, text: str) -> None:
    for pieces in splits(text):
        content, calls, _ = summarize(run(parser_name, pieces)[1])
        assert (content, calls) == (text, []), pieces


COMPLETE_UNTERMINATED = [
    ("hermes", hermes(WEATHER).removesuffix("\n</tool_call>")),
    ("hermes", hermes(WEATHER, True).removesuffix("}\n</tool_call>") + "}"),
    ("qwen3_coder", qwen3_coder(WEATHER).removesuffix("\n</tool_call>")),
    ("qwen3_coder", qwen3_coder(WEATHER).removesuffix("</function>\n</tool_call>")),
    ("seed_oss", seed_oss(WEATHER).removesuffix("\n</seed:tool_call>")),
    ("seed_oss", seed_oss(WEATHER).removesuffix("</function>\n</seed:tool_call>")),
    ("llama3", llama3(WEATHER).removesuffix("}")),
    ("mistral", f"[TOOL_CALLS][{mistral_item(WEATHER)}"),
    ("deepseek", CALLS_BEGIN + deepseek_v31(WEATHER).removesuffix(CALL_END)),
    ("deepseek", CALLS_BEGIN + deepseek_v3(WEATHER).removesuffix("\n```" + CALL_END)),
    ("glm45", glm45(WEATHER).removesuffix("</tool_call>")),
    ("pythonic", f"[{pythonic(WEATHER)}"),
    ("generic", f"```json\n{mistral_item(WEATHER)}"),
]


@pytest.mark.parametrize(("parser_name", "text"), COMPLETE_UNTERMINATED)
def test_a_complete_unterminated_call_is_a_call(parser_name: str, text: str) -> None:
    for pieces in splits(text):
        content, calls, _ = summarize(run(parser_name, pieces)[1])
        assert (content, calls) == ("", [WEATHER]), pieces


INCOMPLETE = [
    ("hermes", '<tool_call>\n{"name": "get_wea'),
    ("hermes", '<tool_call>\n{"arguments": {"city": "Pa'),
    ("qwen3_coder", "<tool_call>\n<function=get_wea"),
    ("seed_oss", "<seed:tool_call>\n<function=get_wea"),
    ("llama3", '{"name": "get_weather", "param'),
    ("mistral", "[TOOL_CALLS]get_weather[AR"),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather"'),
    ("deepseek", f"{CALL_BEGIN}function{SEP}get_weather\n```js"),
    ("glm45", "<tool_call>get_wea"),
    ("pythonic", '[get_weather(city="Pa'),
    ("generic", '{"name": "get_weather", "argu'),
]


@pytest.mark.parametrize(("parser_name", "text"), INCOMPLETE)
def test_an_incomplete_unannounced_call_is_content(parser_name: str, text: str) -> None:
    for pieces in splits(BEFORE + text):
        content, calls, _ = summarize(run(parser_name, pieces)[1])
        assert (content, calls) == (BEFORE + text, []), pieces


def test_an_announced_call_cut_short_keeps_its_partial_arguments() -> None:
    """A call whose first delta went out stays a call; its arguments are what was generated (not valid JSON)."""
    _, events = run("hermes", ['<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa'])
    assert [(e.name, e.arguments) for e in events] == [("get_weather", '{"city": "Pa')]


# -- values typed by schema (qwen3_coder, glm45)

TYPED_TOOLS = [_tool("configure", count="integer", ratio="number", enabled="boolean", strict="boolean",
                     options="object", tags="array", zip="string", version="string", note="string",
                     limit=["integer", "null"])]
TYPED_TEXT = {"count": "3", "ratio": "0.5", "enabled": "true", "strict": "False", "options": '{"depth": 2}',
              "tags": "['a', 'b']", "zip": "12345", "version": "1.10", "note": "line one\nline two",
              "limit": "None", "extra": "42"}
TYPED = {"count": 3, "ratio": 0.5, "enabled": True, "strict": False, "options": {"depth": 2}, "tags": ["a", "b"],
         "zip": "12345", "version": "1.10", "note": "line one\nline two", "limit": None, "extra": 42}


@pytest.mark.parametrize("parser_name", ["qwen3_coder", "seed_oss", "glm45"])
def test_markup_values_are_typed_by_the_schema(parser_name: str) -> None:
    writer = {"qwen3_coder": qwen3_coder, "seed_oss": seed_oss, "glm45": glm45}[parser_name]
    text = writer(("configure", TYPED_TEXT))
    for pieces in ([text], list(text)):
        _, calls, _ = summarize(run(parser_name, pieces, tools=TYPED_TOOLS)[1])
        assert calls == [("configure", TYPED)]


def test_qwen3_coder_strips_one_newline_each_side_of_a_string() -> None:
    text = qwen3_coder(("configure", {"note": "\n  indented\n"}))
    _, calls, _ = summarize(run("qwen3_coder", [text], tools=TYPED_TOOLS)[1])
    assert calls == [("configure", {"note": "\n  indented\n"})]


# -- auto-detection and the families' templates


def test_registry_order_puts_specific_formats_first_and_generic_last() -> None:
    names = list(TOOL_PARSERS)
    assert names.index("qwen3_coder") < names.index("hermes") and names.index("glm45") < names.index("hermes")
    assert names.index("seed_oss") < names.index("qwen3_coder")  # Seed-OSS templates show <function=...> too
    assert names.index("pythonic") < names.index("llama3") and names[-1] == "generic"


@pytest.mark.parametrize("family", sorted(TOOL_TEMPLATES))
def test_detects_each_familys_parser(family: str) -> None:
    assert detect_tool_parser(TOOL_TEMPLATES[family]) is TOOL_PARSERS[EXPECTED_PARSER[family]]


def test_detects_nothing_for_a_template_without_tools() -> None:
    from tests.support.tiny import CHAT_TEMPLATE

    assert detect_tool_parser(NO_TOOLS_TEMPLATE) is None
    assert detect_tool_parser(None) is None and detect_tool_parser("") is None
    assert detect_tool_parser(CHAT_TEMPLATE) is TOOL_PARSERS["hermes"]  # the tiny test models' ChatML


@pytest.fixture(scope="module")
def hf_tokenizer() -> Any:
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>"))
    return PreTrainedTokenizerFast(tokenizer_object=vocab, bos_token="<s>", eos_token="</s>")


END_OF_TURN = {"qwen3": "<|im_end|>", "qwen3_coder": "<|im_end|>", "llama3.1": "<|eot_id|>", "mistral": "</s>",
               "deepseek_v3": "<｜end▁of▁sentence｜>", "deepseek_v3.1": "<｜end▁of▁sentence｜>", "glm4.5": None,
               "seed_oss": "<seed:eos>"}


@pytest.mark.parametrize("family", sorted(TOOL_TEMPLATES))
def test_a_familys_template_writes_calls_its_parser_reads_back(family: str, hf_tokenizer: Any) -> None:
    template = TOOL_TEMPLATES[family]
    expected = [WEATHER] if family == "llama3.1" else [WEATHER, TIME]  # Llama 3.1: one call per message
    string_args = family.startswith("deepseek")  # its templates concatenate the arguments as text
    tool_calls = [{"id": f"call{i:05d}", "type": "function",
                   "function": {"name": name, "arguments": json.dumps(args) if string_args else args}}
                  for i, (name, args) in enumerate(expected)]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"}]

    def render(messages: list, add_generation_prompt: bool) -> str:
        return hf_tokenizer.apply_chat_template(messages, tools=TOOLS, chat_template=template, tokenize=False,
                                                add_generation_prompt=add_generation_prompt)

    prompt = render(messages, True)
    full = render([*messages, {"role": "assistant", "content": "", "tool_calls": tool_calls}], False)
    if not family.startswith("deepseek"):  # DeepSeek's published templates leave the tool list to the caller
        assert "get_weather" in prompt and "get_time" in prompt
    assert full.startswith(prompt)
    generated = full[len(prompt):]
    if END_OF_TURN[family]:
        generated = generated.split(END_OF_TURN[family])[0]
    generated = re.sub(r"^\s*<think>.*?</think>", "", generated, flags=re.S)
    for pieces in ([generated], list(generated)):
        content, calls, _ = summarize(run(EXPECTED_PARSER[family], pieces)[1])
        assert calls == expected and not content.strip(), (generated, content)
