"""Request intent (``mlxd.api.intent``): each shared rule's outcomes over neutral inputs, and the same intent written
in each surface's own schema (OpenAI chat, Anthropic Messages, Responses) reaching the same job.

The oracles are tables written by hand from the APIs' documented meaning: which ``tool_choice`` and tools the
template sees, which template switches thinking sets, which format the parser enforces, which stops and sampling
values the engine gets, and which field a refusal names."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from mlxd.api import anthropic_jobs, intent, jobs, responses_jobs
from mlxd.api.anthropic_schemas import CountTokensRequest, MessagesRequest
from mlxd.api.intent import ToolChoice, Words
from mlxd.api.responses_schemas import ResponsesRequest
from mlxd.api.schemas import ChatCompletionRequest, CompletionRequest
from mlxd.config.schema import SamplingDefaults
from mlxd.engine.base import SamplingParams
from mlxd.errors import RequestError
from mlxd.pipeline.stage import ModelInfo
from mlxd.pipeline.stops import MAX_STOP_CHARS, MAX_STOPS

DEFAULTS = SamplingDefaults(temperature=0.7, top_p=0.9, top_k=40, min_p=0.05, repetition_penalty=1.1)
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
CHAT_TOOLS = [{"type": "function", "function": {"name": n, "parameters": SCHEMA}} for n in ("get_weather", "search")]
NAMED = {"type": "function", "function": {"name": "search"}}


def model(vocab: int) -> ModelInfo:
    return ModelInfo(name="m", context_length=4096, eos_token_ids=frozenset(), special_token_ids=frozenset(),
                     vocab_size=vocab)


def refusal(call, *args, **kwargs) -> RequestError:
    with pytest.raises(RequestError) as info:
        call(*args, **kwargs)
    assert info.value.status == 400
    return info.value


# ---- the rules over neutral inputs ----


@pytest.mark.parametrize(("choice", "tools", "expected"), [
    (ToolChoice(), CHAT_TOOLS, ("auto", CHAT_TOOLS)),
    (ToolChoice(), None, ("auto", None)),
    (ToolChoice(), [], ("auto", None)),
    (ToolChoice("none"), CHAT_TOOLS, ("none", None)),
    (ToolChoice("none"), None, ("none", None)),
    (ToolChoice("required"), CHAT_TOOLS, ("required", CHAT_TOOLS)),
    (ToolChoice("named", name="search"), CHAT_TOOLS, (NAMED, CHAT_TOOLS)),
])
def test_tool_choice_outcomes(choice, tools, expected):
    assert intent.resolve_tool_choice(choice, tools) == expected


@pytest.mark.parametrize(("choice", "tools", "words", "message"), [
    (ToolChoice("required"), None, Words(), "tool_choice 'required' needs at least one tool in `tools`"),
    (ToolChoice("required", spelled="any"), [], Words(tool="custom tool"),
     "tool_choice 'any' needs at least one custom tool in `tools`"),
    (ToolChoice("named", name="nope"), CHAT_TOOLS, Words(tool="function tool"),
     "tool_choice names 'nope', which is not among the request's function tools ['get_weather', 'search']"),
    (ToolChoice("named", name="nope"), None, Words(),
     "tool_choice names 'nope', which is not among the request's tools []"),
])
def test_forced_tool_choices_need_their_tools(choice, tools, words, message):
    error = refusal(intent.resolve_tool_choice, choice, tools, words)
    assert (error.message, error.param) == (message, "tool_choice")


def test_a_tool_choice_error_lists_at_most_16_names():
    tools = [{"type": "function", "function": {"name": f"t{i}"}} for i in range(40)]
    error = refusal(intent.resolve_tool_choice, ToolChoice("named", name="x"), tools)
    assert error.message.endswith(str([f"t{i}" for i in range(16)]))


def test_sampling_takes_the_defaults_for_what_the_request_leaves_unset():
    assert intent.sampling(DEFAULTS) == SamplingParams(temperature=0.7, top_p=0.9, top_k=40, min_p=0.05,
                                                       repetition_penalty=1.1)
    asked = intent.sampling(DEFAULTS, temperature=0.0, top_p=0.5, top_k=0, min_p=0.0, repetition_penalty=0.0,
                            seed=7, presence_penalty=0.5, frequency_penalty=-0.5, logit_bias={3: -100.0})
    # 0 is a value the request asked for (greedy, top_k off), not a missing one.
    assert asked == SamplingParams(temperature=0.0, top_p=0.5, top_k=0, min_p=0.0, repetition_penalty=0.0, seed=7,
                                   presence_penalty=0.5, frequency_penalty=-0.5, logit_bias={3: -100.0})
    unresolved = intent.sampling(SamplingDefaults())
    assert (unresolved.repetition_penalty, unresolved.presence_penalty, unresolved.logit_bias) == (0.0, 0.0, None)


@pytest.mark.parametrize(("kwargs", "expected"), [
    ({}, {}),
    ({"effort": "none"}, {"enable_thinking": False, "reasoning_effort": "none"}),
    ({"effort": "minimal"}, {"enable_thinking": False, "reasoning_effort": "low"}),
    ({"effort": "low"}, {"enable_thinking": True, "reasoning_effort": "low"}),
    ({"effort": "medium"}, {"enable_thinking": True, "reasoning_effort": "medium"}),
    ({"effort": "high"}, {"enable_thinking": True, "reasoning_effort": "high"}),
    ({"effort": "xhigh"}, {"enable_thinking": True, "reasoning_effort": "high"}),
    ({"enabled": True}, {"enable_thinking": True}),
    ({"enabled": False}, {"enable_thinking": False}),
])
def test_thinking_switches(kwargs, expected):
    assert intent.thinking_switches(**kwargs) == expected


@pytest.mark.parametrize(("args", "kwargs", "expected"), [
    ((None,), {}, None),
    (("text",), {}, None),
    (("json_object",), {}, {"type": "json_object"}),
    (("json_schema", SCHEMA), {}, {"type": "json_schema", "schema": SCHEMA, "strict": False, "name": None}),
    (("json_schema", SCHEMA), {"strict": None, "name": "w"},
     {"type": "json_schema", "schema": SCHEMA, "strict": False, "name": "w"}),
    (("json_schema", SCHEMA), {"strict": True}, {"type": "json_schema", "schema": SCHEMA, "strict": True,
                                                 "name": None}),
])
def test_response_format_outcomes(args, kwargs, expected):
    assert intent.response_format(*args, **kwargs) == expected


@pytest.mark.parametrize(("schema", "words", "message", "param"), [
    (None, Words(), "response_format json_schema needs `json_schema.schema`, a JSON schema object",
     "response_format"),
    ([1], responses_jobs.WORDS, "text.format json_schema needs `schema`, a JSON schema object", "text"),
])
def test_a_json_schema_format_needs_a_schema_object(schema, words, message, param):
    error = refusal(intent.response_format, "json_schema", schema, words=words)
    assert (error.message, error.param) == (message, param)


def test_stops_one_string_or_a_list_empty_ones_dropped_bounded():
    assert intent.stops(None, "stop") == []
    assert intent.stops("END", "stop") == ["END"]
    assert intent.stops(["a", "", "b"], "stop_sequences") == ["a", "b"]
    assert intent.stops(["x"] * MAX_STOPS, "stop") == ["x"] * MAX_STOPS
    assert refusal(intent.stops, ["x"] * (MAX_STOPS + 1), "stop_sequences").param == "stop_sequences"
    assert refusal(intent.stops, "y" * (MAX_STOP_CHARS + 1), "stop").param == "stop"


@pytest.mark.parametrize(("kwargs", "param"), [
    ({"top_k": 100}, "top_k"),
    ({"logit_bias_ids": [5, 100]}, "logit_bias"),
    ({"prompt_ids": [0, 99, 100]}, "prompt"),
])
def test_token_ids_must_be_below_the_vocabulary(kwargs, param):
    assert refusal(intent.check_vocabulary, model(100), **kwargs).param == param
    # Unknown vocabulary (before the model loads): nothing to check against.
    intent.check_vocabulary(None, **kwargs)
    intent.check_vocabulary(model(0), **kwargs)


def test_token_ids_below_the_vocabulary_pass():
    intent.check_vocabulary(model(100), top_k=99, logit_bias_ids=[0, 99], prompt_ids=[0, 99])


# ---- one intent, three surfaces ----


def chat(**fields) -> Any:
    body = msgspec.convert({"model": "m", "messages": [{"role": "user", "content": "Hi"}], **fields},
                           ChatCompletionRequest)
    return jobs.chat_job(body, "m", DEFAULTS)


def messages(**fields) -> Any:
    body = msgspec.convert({"model": "m", "max_tokens": 64, "messages": [{"role": "user", "content": "Hi"}],
                            **fields}, MessagesRequest)
    return anthropic_jobs.messages_job(body, "m", DEFAULTS)


def responses(**fields) -> Any:
    body = msgspec.convert({"model": "m", "input": "Hi", **fields}, ResponsesRequest)
    return responses_jobs.responses_job(body, "m", DEFAULTS)[0]


OPENAI_TOOLS = [{"type": "function", "function": {"name": n, "parameters": SCHEMA}} for n in ("get_weather", "search")]
ANTHROPIC_TOOLS = [{"name": n, "input_schema": SCHEMA} for n in ("get_weather", "search")]
RESPONSES_TOOLS = [{"type": "function", "name": n, "parameters": SCHEMA} for n in ("get_weather", "search")]

# intent: (chat fields, messages fields, responses fields), and the tool_choice and tool names every job gets.
TOOL_CHOICES = {
    "absent": ({"tools": OPENAI_TOOLS}, {"tools": ANTHROPIC_TOOLS}, {"tools": RESPONSES_TOOLS},
               "auto", ["get_weather", "search"]),
    "auto": ({"tools": OPENAI_TOOLS, "tool_choice": "auto"},
             {"tools": ANTHROPIC_TOOLS, "tool_choice": {"type": "auto"}},
             {"tools": RESPONSES_TOOLS, "tool_choice": "auto"}, "auto", ["get_weather", "search"]),
    "none": ({"tools": OPENAI_TOOLS, "tool_choice": "none"},
             {"tools": ANTHROPIC_TOOLS, "tool_choice": {"type": "none"}},
             {"tools": RESPONSES_TOOLS, "tool_choice": "none"}, "none", None),
    "required": ({"tools": OPENAI_TOOLS, "tool_choice": "required"},
                 {"tools": ANTHROPIC_TOOLS, "tool_choice": {"type": "any"}},
                 {"tools": RESPONSES_TOOLS, "tool_choice": "required"}, "required", ["get_weather", "search"]),
    "named": ({"tools": OPENAI_TOOLS, "tool_choice": {"type": "function", "function": {"name": "search"}}},
              {"tools": ANTHROPIC_TOOLS, "tool_choice": {"type": "tool", "name": "search"}},
              {"tools": RESPONSES_TOOLS, "tool_choice": {"type": "function", "name": "search"}},
              NAMED, ["get_weather", "search"]),
    "no tools": ({}, {}, {}, "auto", None),
}


@pytest.mark.parametrize("case", TOOL_CHOICES)
def test_a_tool_choice_means_the_same_on_every_surface(case):
    chat_fields, messages_fields, responses_fields, choice, names = TOOL_CHOICES[case]
    for job in (chat(**chat_fields), messages(**messages_fields), responses(**responses_fields)):
        assert job.tool_choice == choice
        assert (None if job.tools is None else [t["function"]["name"] for t in job.tools]) == names
        assert job.parallel_tool_calls is True


def test_parallel_tool_calls_off_on_every_surface():
    assert chat(tools=OPENAI_TOOLS, parallel_tool_calls=False).parallel_tool_calls is False
    off = {"type": "auto", "disable_parallel_tool_use": True}
    assert messages(tools=ANTHROPIC_TOOLS, tool_choice=off).parallel_tool_calls is False
    assert responses(tools=RESPONSES_TOOLS, parallel_tool_calls=False).parallel_tool_calls is False


@pytest.mark.parametrize(("surface", "fields", "message"), [
    (chat, {"tool_choice": "required"}, "tool_choice 'required' needs at least one tool in `tools`"),
    (messages, {"tool_choice": {"type": "any"}}, "tool_choice 'any' needs at least one custom tool in `tools`"),
    (responses, {"tool_choice": "required"}, "tool_choice 'required' needs at least one function tool in `tools`"),
    (chat, {"tools": OPENAI_TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice names 'nope', which is not among the request's tools ['get_weather', 'search']"),
    (messages, {"tools": ANTHROPIC_TOOLS, "tool_choice": {"type": "tool", "name": "nope"}},
     "tool_choice names 'nope', which is not among the request's custom tools ['get_weather', 'search']"),
    (messages, {"tool_choice": {"type": "tool", "name": "nope"}},
     "tool_choice names 'nope', which is not among the request's custom tools []"),
    (responses, {"tools": RESPONSES_TOOLS, "tool_choice": {"type": "function", "name": "nope"}},
     "tool_choice names 'nope', which is not among the request's function tools ['get_weather', 'search']"),
])
def test_a_forced_tool_choice_without_its_tool_is_refused_in_each_surface_s_words(surface, fields, message):
    error = refusal(surface, **fields)
    assert (error.message, error.param) == (message, "tool_choice")


def test_responses_allowed_tools_picks_tools_then_applies_its_mode():
    allowed = {"type": "allowed_tools", "mode": "required", "tools": [{"type": "function", "name": "search"}]}
    job = responses(tools=RESPONSES_TOOLS, tool_choice=allowed)
    assert (job.tool_choice, [t["function"]["name"] for t in job.tools]) == ("required", ["search"])
    none_allowed = {**allowed, "tools": [{"type": "function", "name": "absent"}]}
    assert refusal(responses, tools=RESPONSES_TOOLS, tool_choice=none_allowed).param == "tool_choice"


# intent: (chat fields, messages fields, responses fields, template variables). Anthropic sets the switch only.
THINKING = {
    "absent": ({}, {}, {}, {}, {}),
    "off": ({"reasoning_effort": "none"}, {"thinking": {"type": "disabled"}}, {"reasoning": {"effort": "none"}},
            {"enable_thinking": False, "reasoning_effort": "none"}, {"enable_thinking": False}),
    "on": ({"reasoning_effort": "high"}, {"thinking": {"type": "enabled", "budget_tokens": 2048}},
           {"reasoning": {"effort": "high"}}, {"enable_thinking": True, "reasoning_effort": "high"},
           {"enable_thinking": True}),
    "adaptive": ({"reasoning_effort": "medium"}, {"thinking": {"type": "adaptive"}},
                 {"reasoning": {"effort": "medium"}}, {"enable_thinking": True, "reasoning_effort": "medium"},
                 {"enable_thinking": True}),
    "minimal": ({"reasoning_effort": "minimal"}, {"thinking": {"type": "disabled"}},
                {"reasoning": {"effort": "minimal"}}, {"enable_thinking": False, "reasoning_effort": "low"},
                {"enable_thinking": False}),
}


@pytest.mark.parametrize("case", THINKING)
def test_thinking_means_the_same_on_every_surface(case):
    chat_fields, messages_fields, responses_fields, effort_switches, anthropic_switches = THINKING[case]
    assert chat(**chat_fields).template_kwargs == effort_switches
    assert responses(**responses_fields).template_kwargs == effort_switches
    assert messages(**messages_fields).template_kwargs == anthropic_switches


def test_a_thinking_budget_is_accepted_not_enforced():
    small = messages(thinking={"type": "enabled", "budget_tokens": 1024})
    large = messages(thinking={"type": "enabled", "budget_tokens": 16000})
    assert small.template_kwargs == large.template_kwargs == {"enable_thinking": True}
    assert small.max_tokens == large.max_tokens == 64


def test_explicit_template_switches_win_over_the_effort():
    job = chat(reasoning_effort="high", chat_template_kwargs={"enable_thinking": False})
    assert job.template_kwargs == {"enable_thinking": False, "reasoning_effort": "high"}


@pytest.mark.parametrize(("chat_format", "responses_format", "expected"), [
    (None, None, None),
    ({"type": "text"}, {"type": "text"}, None),
    ({"type": "json_object"}, {"type": "json_object"}, {"type": "json_object"}),
    ({"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA, "strict": True}},
     {"type": "json_schema", "name": "w", "schema": SCHEMA, "strict": True},
     {"type": "json_schema", "schema": SCHEMA, "strict": True, "name": "w"}),
    ({"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA}},
     {"type": "json_schema", "name": "w", "schema": SCHEMA},
     {"type": "json_schema", "schema": SCHEMA, "strict": False, "name": "w"}),
])
def test_a_response_format_means_the_same_on_both_openai_surfaces(chat_format, responses_format, expected):
    chat_fields = {"response_format": chat_format} if chat_format else {}
    responses_fields = {"text": {"format": responses_format}} if responses_format else {}
    assert chat(**chat_fields).response_format == expected
    assert responses(**responses_fields).response_format == expected


def test_a_json_schema_format_without_a_schema_names_each_surface_s_field():
    error = refusal(chat, response_format={"type": "json_schema", "json_schema": {"name": "w"}})
    assert (error.param, "`json_schema.schema`" in error.message) == ("response_format", True)
    error = refusal(responses, text={"format": {"type": "json_schema", "name": "w"}})
    assert (error.param, "`schema`" in error.message) == ("text", True)


def test_stops_on_each_surface():
    assert chat(stop="END").stop == ["END"]
    assert chat(stop=["a", ""]).stop == ["a"]
    assert messages(stop_sequences=["\n\nHuman:", ""]).stop == ["\n\nHuman:"]
    assert jobs.completion_job(msgspec.convert({"model": "m", "prompt": "x", "stop": "Q:"}, CompletionRequest),
                               "m", DEFAULTS).stop == ["Q:"]
    too_many = [f"s{i}" for i in range(MAX_STOPS + 1)]
    assert refusal(chat, stop=too_many).param == "stop"
    assert refusal(messages, stop_sequences=too_many).param == "stop_sequences"


def test_sampling_defaults_on_each_surface():
    assert chat().sampling == messages().sampling == responses().sampling == intent.sampling(DEFAULTS)
    asked = {"temperature": 0.0, "top_p": 0.5}
    assert chat(**asked).sampling == messages(**asked).sampling == responses(**asked).sampling == SamplingParams(
        temperature=0.0, top_p=0.5, top_k=40, min_p=0.05, repetition_penalty=1.1)
    assert chat(top_k=3).sampling.top_k == messages(top_k=3).sampling.top_k == 3
    biased = chat(logit_bias={"17": -100}, seed=5, presence_penalty=0.25, min_p=0.0, repetition_penalty=1.0)
    assert (biased.sampling.logit_bias, biased.sampling.seed, biased.sampling.presence_penalty) == ({17: -100.0}, 5,
                                                                                                     0.25)
    assert (biased.sampling.min_p, biased.sampling.repetition_penalty) == (0.0, 1.0)


def test_the_vocabulary_check_on_each_surface():
    openai = msgspec.convert({"model": "m", "messages": [], "top_k": 100}, ChatCompletionRequest)
    assert refusal(jobs.check_vocabulary, openai, model(100)).param == "top_k"
    openai = msgspec.convert({"model": "m", "messages": [], "logit_bias": {"100": 1}}, ChatCompletionRequest)
    assert refusal(jobs.check_vocabulary, openai, model(100)).param == "logit_bias"
    completion = msgspec.convert({"model": "m", "prompt": [1, 100]}, CompletionRequest)
    assert refusal(jobs.check_vocabulary, completion, model(100)).param == "prompt"
    jobs.check_vocabulary(msgspec.convert({"model": "m", "prompt": [1, 99]}, CompletionRequest), model(100))
    anthropic = msgspec.convert({"model": "m", "max_tokens": 1, "messages": [], "top_k": 100}, MessagesRequest)
    assert refusal(anthropic_jobs.check_vocabulary, anthropic, model(100)).param == "top_k"
    anthropic_jobs.check_vocabulary(anthropic, model(101))


def test_empty_messages_are_refused_on_each_surface():
    assert refusal(chat, messages=[]).param == "messages"
    assert refusal(messages, messages=[]).param == "messages"
    assert refusal(responses, input=[]).param == "input"
    empty = msgspec.convert({"model": "m", "prompt": ""}, CompletionRequest)
    assert refusal(jobs.completion_job, empty, "m", DEFAULTS).param == "prompt"


@pytest.mark.parametrize(("blocks", "system"), [
    (["x-anthropic-billing-header: cc_version=2.1.197.c23; cc_entrypoint=sdk-cli;", "You are terse."],
     "You are terse."),
    (["x-anthropic-billing-header: cch=1;\n", "A", "\nB"], "A\nB"),
    (["x-anthropic-billing-header: cch=1;\nKeep this.", "A"], "Keep this.A"),
    # Only at the start of a block: anywhere else the text is the client's own.
    (["A ", "see x-anthropic-billing-header: in the docs"], "A see x-anthropic-billing-header: in the docs"),
    (["x-anthropic-billing-header: cch=1;"], None),
])
def test_the_billing_header_block_is_left_out_of_the_system_prompt(blocks, system):
    body = msgspec.convert({"model": "m", "messages": [{"role": "user", "content": "Hi"}],
                            "system": [{"type": "text", "text": text} for text in blocks]}, CountTokensRequest)
    job = anthropic_jobs.prompt_job(body, "m")
    first = job.messages[0]
    assert (first["content"] if first["role"] == "system" else None) == system


@pytest.mark.parametrize(("choice", "expected"), [
    (None, ToolChoice("auto")), ("auto", ToolChoice("auto")), ("none", ToolChoice("none")),
    ("required", ToolChoice("required")), ("any", None), (NAMED, None),
])
def test_plain_tool_choices(choice, expected):
    assert intent.plain_tool_choice(choice) == expected


def test_check_not_empty():
    intent.check_not_empty([{"role": "user"}], "messages")
    intent.check_not_empty("x", "prompt")
    for empty in ([], "", None):
        error = refusal(intent.check_not_empty, empty, "input")
        assert (error.message, error.param) == ("`input` must not be empty", "input")
