"""Tool calls end to end, through the real ``openai`` SDK against daemons on loopback, one per model family.

Each daemon serves the tiny model under a fixture chat template that reproduces its family's published format
(``tests.support.tool_templates``, ``tests.support.harmony_template``), with ``tool_parser = "auto"``, and a scripted
model double (``tests.scripted_server``) that generates exactly what the family's template renders for an
assistant turn with tool calls: the format's own token sequence. The oracle is the call the template rendered:
the parsed calls (streamed and not) must equal it, no markup may reach ``content``, and ``finish_reason`` must be
``tool_calls``. The tool-less default pipeline (a template with no tool format) gets Hermes tools and constrained
``tool_choice``.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from pathlib import Path

import openai
import pytest
from transformers import AutoTokenizer

from mlxd.pipeline.parsers.registry import tool_parser_for
from tests.helpers import free_port, stop_process, wait_healthy, write_config
from tests.support.harmony_template import GPT_OSS_TEMPLATE
from tests.support.tool_templates import EXPECTED_PARSER, TOOL_TEMPLATES

TEMPLATES = {**TOOL_TEMPLATES, "gpt-oss": GPT_OSS_TEMPLATE}
PARSERS = {**EXPECTED_PARSER, "gpt-oss": "harmony"}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather for a city.", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        "required": ["city"]}}},
    {"type": "function", "function": {"name": "search", "description": "Search the web.", "parameters": {
        "type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}},
]
CALLS = [("get_weather", {"city": "Paris", "days": 3}), ("search", {"query": "umbrella"})]
# Templates that render one call per assistant turn, or no text beside calls.
SINGLE_CALL = {"llama3.1", "gpt-oss"}
NO_CONTENT = {"llama3.1", "mistral", "gpt-oss"}
END_MARKERS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "</s>", "<｜end▁of▁sentence｜>", "<|endoftext|>",
               "<|return|>", "<|end|>", "<|user|>", "<seed:eos>")
USER = [{"role": "user", "content": "What is the weather in Paris?"}]
SCRIPTS: dict[str, Path] = {}  # family → the file its scripted model reads


def expected(family: str) -> tuple[str, list[tuple[str, dict]]]:
    calls = CALLS[:1] if family in SINGLE_CALL else CALLS
    return ("" if family in NO_CONTENT else "Let me check."), calls


def assistant_turn(family: str, tokenizer) -> str:
    """What the family's template renders for the assistant's tool-call turn: the model's output."""
    content, calls = expected(family)
    # DeepSeek's templates concatenate the arguments as text (mlxd's normalize stage detects that and sends text).
    as_text = family.startswith("deepseek")
    message = {"role": "assistant", "content": content, "tool_calls": [
        {"id": f"call_{i}", "type": "function",
         "function": {"name": name, "arguments": json.dumps(args) if as_text else args}}
        for i, (name, args) in enumerate(calls)]}
    template = TEMPLATES[family]
    render = lambda messages, gen: tokenizer.apply_chat_template(  # noqa: E731
        messages, tools=TOOLS, chat_template=template, tokenize=False, add_generation_prompt=gen)
    prompt, whole = render(USER, True), render([*USER, message], False)
    assert whole.startswith(prompt), family
    turn = whole[len(prompt):].rstrip()
    while turn.endswith(END_MARKERS):
        turn = turn[: -len(next(m for m in END_MARKERS if turn.endswith(m)))].rstrip()
    return turn


@pytest.fixture(scope="module")
def servers(tiny_model_dir, tmp_path_factory):
    """One scripted daemon per family, started together."""
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    procs, bases = {}, {}
    with contextlib.ExitStack() as stack:
        for family, template in TEMPLATES.items():
            tmp = tmp_path_factory.mktemp(family.replace(".", "_"))
            (tmp / "template.jinja").write_text(template)
            script = SCRIPTS[family] = tmp / "script.txt"
            script.write_text(assistant_turn(family, tokenizer))
            port = free_port()
            config = write_config(tmp, tiny_model_dir, port=port, model_extra='chat_template = "template.jinja"',
                                  extra="[engine]\nprefix_cache_bytes = 0\nmax_running = 2\n")
            log = open(tmp / "server.log", "wb")  # noqa: SIM115 - closed by the exit stack
            stack.callback(log.close)
            proc = subprocess.Popen([sys.executable, "-m", "tests.scripted_server", str(config), str(script)],
                                    stdout=log, stderr=subprocess.STDOUT, cwd=Path(__file__).parent.parent)
            stack.callback(stop_process, proc)
            procs[family], bases[family] = (proc, tmp), f"http://127.0.0.1:{port}"
        for family, (proc, tmp) in procs.items():
            wait_healthy(bases[family], proc, 180, tmp / "server.log")
        yield {family: openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
               for family, base in bases.items()}


@contextlib.contextmanager
def scripted(servers, family: str, text: str):
    """The family's daemon generates ``text`` for the requests made inside this block."""
    path = SCRIPTS[family]
    before = path.read_text()
    path.write_text(text)
    try:
        yield servers[family]
    finally:
        path.write_text(before)


@pytest.mark.parametrize("family", list(TEMPLATES))
def test_auto_picks_the_family_s_parser(family):
    assert tool_parser_for("auto", TEMPLATES[family]).name == PARSERS[family]


@pytest.mark.parametrize("family", list(TEMPLATES))
def test_tool_calls_streamed_and_not_equal_the_rendered_calls(servers, family):
    client = servers[family]
    content, calls = expected(family)
    result = client.chat.completions.create(model="tiny", messages=USER, tools=TOOLS, max_tokens=400)
    choice = result.choices[0]
    got = [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls or []]
    assert got == calls, choice.message
    assert (choice.message.content or "").strip() == content
    assert choice.finish_reason == "tool_calls"
    assert all(c.id.startswith("call_") and c.type == "function" for c in choice.message.tool_calls)

    parts: dict[int, dict] = {}
    text, finish = [], None
    for chunk in client.chat.completions.create(model="tiny", messages=USER, tools=TOOLS, max_tokens=400,
                                                stream=True):
        delta = chunk.choices[0].delta
        text.append(delta.content or "")
        for call in delta.tool_calls or []:
            part = parts.setdefault(call.index, {"name": None, "arguments": ""})
            if call.function.name:
                assert part["name"] is None and call.id  # the name comes once, first, with the id
                part["name"] = call.function.name
            part["arguments"] += call.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    streamed = [(p["name"], json.loads(p["arguments"])) for _, p in sorted(parts.items())]
    assert streamed == calls
    assert "".join(text).strip() == content
    for marker in ("<tool_call>", "<function=", "[TOOL_CALLS]", "tool▁call", "<|channel|>", "<arg_key>", '"name"',
                   "seed:tool_call"):
        assert marker not in "".join(text)
    assert finish == "tool_calls"


def test_a_call_to_a_tool_the_request_does_not_have_comes_back_as_text(servers):
    client = servers["qwen3"]
    only_search = [TOOLS[1]]
    result = client.chat.completions.create(model="tiny", messages=USER, tools=only_search, max_tokens=400)
    choice = result.choices[0]
    assert [c.function.name for c in choice.message.tool_calls or []] == ["search"]
    assert "get_weather" in choice.message.content and choice.finish_reason == "tool_calls"


@pytest.mark.parametrize(("family", "text"), [
    ("qwen3", "<think>\nThe user wants weather.\n</think>\n\nIt is sunny."),
    ("glm4.5", "\n<think>The user wants weather.</think>\nIt is sunny."),
    ("seed_oss", "<seed:think>The user wants weather.</seed:think>\nIt is sunny."),
    ("gpt-oss", "<|channel|>analysis<|message|>The user wants weather.<|end|><|start|>assistant<|channel|>final"
                "<|message|>It is sunny."),
])
def test_reasoning_is_kept_apart_from_the_answer(servers, family, text):
    with scripted(servers, family, text) as client:
        message = client.chat.completions.create(model="tiny", messages=USER, max_tokens=200).choices[0].message
        assert message.content.strip() == "It is sunny."
        assert message.model_extra["reasoning_content"].strip() == "The user wants weather."
        reasoning, content = [], []
        for chunk in client.chat.completions.create(model="tiny", messages=USER, max_tokens=200, stream=True):
            delta = chunk.choices[0].delta
            content.append(delta.content or "")
            reasoning.append((delta.model_extra or {}).get("reasoning_content") or "")
    assert "".join(content).strip() == "It is sunny."
    assert "".join(reasoning).strip() == "The user wants weather."


def test_an_unterminated_call_at_the_end_is_still_a_call_when_its_json_is_complete(servers):
    with scripted(servers, "qwen3", '<tool_call>\n{"name": "search", "arguments": {"query": "umbrella"}}') as client:
        choice = client.chat.completions.create(model="tiny", messages=USER, tools=TOOLS, max_tokens=200).choices[0]
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == [CALLS[1]]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
