"""The normalize stage on real agent traffic, against the tiny model's ChatML template and a strict one."""

from __future__ import annotations

import os

import pytest
from mlx_lm.tokenizer_utils import load as load_tokenizer

from mlxd.config.load import convert
from mlxd.errors import RequestError
from mlxd.pipeline.job import Job
from mlxd.pipeline.stage import ModelInfo, PipelineContext
from mlxd.pipeline.stages.normalize import MID_SYSTEM_PREFIX, Normalize, NormalizeConfig

# A template in the style of models that refuse system messages after the start and require alternation.
STRICT = (
    "{% for m in messages %}"
    "{% if m['role'] == 'system' and not loop.first %}{{ raise_exception('system only first') }}{% endif %}"
    "{% if loop.index0 > 0 and m['role'] == messages[loop.index0 - 1]['role'] %}"
    "{{ raise_exception('roles must alternate') }}{% endif %}"
    "[{{ m['role'] }}]{{ m['content'] }}"
    "{% endfor %}"
)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return load_tokenizer(tiny_model_dir)


def stage(tokenizer, template: str | None = None, **options) -> Normalize:
    if template is not None:
        tokenizer.chat_template = template
    normalize = Normalize(convert(options, NormalizeConfig, "test"))
    info = ModelInfo("tiny", 256, frozenset(), frozenset())
    normalize.warm_up(PipelineContext(config=None, model=info, tokenizer=tokenizer, engine=None))
    return normalize


def run(normalize: Normalize, messages: list[dict]) -> list[dict]:
    job = Job(request_id="r", model="tiny", messages=messages)
    normalize.prepare(job)
    return job.messages


def test_agent_traffic_is_normalized(tokenizer):
    normalize = stage(tokenizer)
    messages = run(normalize, [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "ls", "arguments": '{"path": "/tmp"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "a.txt"},
    ])
    assert messages[0] == {"role": "system", "content": "Be brief."}
    assert messages[1]["content"] == "one\ntwo"
    assert messages[2]["content"] == "" and messages[2]["tool_calls"][0]["function"]["arguments"] == {"path": "/tmp"}
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert '"path"' in rendered and "a.txt" in rendered


def test_invalid_tool_arguments_are_a_clear_400(tokenizer):
    normalize = stage(tokenizer)
    with pytest.raises(RequestError, match="not valid JSON"):
        run(normalize, [{"role": "assistant", "content": "", "tool_calls": [
            {"function": {"name": "f", "arguments": "{oops"}}]}])


def test_chatml_keeps_mid_system_in_place_and_consecutive_turns(tokenizer):
    normalize = stage(tokenizer)
    assert normalize.mid_system_in_place and not normalize.requires_alternation
    conversation = [{"role": "system", "content": "S"}, {"role": "user", "content": "a"},
                    {"role": "user", "content": "b"}, {"role": "system", "content": "MID"}]
    assert run(normalize, conversation) == conversation


def test_strict_template_gets_merged_turns_and_marked_system(tokenizer):
    normalize = stage(tokenizer, STRICT)
    assert normalize.requires_alternation and not normalize.mid_system_in_place
    messages = run(normalize, [
        {"role": "system", "content": "S"}, {"role": "user", "content": "a"}, {"role": "user", "content": "b"},
        {"role": "assistant", "content": "c"}, {"role": "system", "content": "MID"},
        {"role": "user", "content": "d"}])
    assert messages == [
        {"role": "system", "content": "S"}, {"role": "user", "content": "a\n\nb"},
        {"role": "assistant", "content": "c"}, {"role": "user", "content": MID_SYSTEM_PREFIX + "MID\n\nd"}]
    # The start of the prompt is unchanged, which is what keeps prefix caching effective.
    assert tokenizer.apply_chat_template(messages, tokenize=False).startswith("[system]S[user]a")


def test_hoisting_is_opt_in(tokenizer):
    normalize = stage(tokenizer, STRICT, hoist_system=True)
    messages = run(normalize, [{"role": "system", "content": "S"}, {"role": "user", "content": "a"},
                               {"role": "assistant", "content": "c"}, {"role": "system", "content": "MID"},
                               {"role": "user", "content": "d"}])
    assert messages[0] == {"role": "system", "content": "S\n\nMID"}
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user"]


BILLING_1 = "x-anthropic-billing-header: cc_version=2.1.197.c23; cc_entrypoint=sdk-cli;"
BILLING_2 = "x-anthropic-billing-header: cc_version=2.1.197.a5a; cc_entrypoint=cli;"
CLAUDE_SYSTEM = ["You are a Claude agent, built on Anthropic's Claude Agent SDK.", "\nYou are an interactive agent."]


@pytest.fixture(scope="module")
def chatml(tiny_model_dir):
    """A tokenizer of its own: the other tests here swap the shared one's template for STRICT."""
    return load_tokenizer(tiny_model_dir)


def claude_code_turn(billing: str, question: str) -> list[dict]:
    """A request as the Anthropic surface hands it on: the system blocks as text parts, the billing line first."""
    parts = [{"type": "text", "text": t} for t in (billing, *CLAUDE_SYSTEM)]
    return [{"role": "system", "content": parts}, {"role": "user", "content": question}]


def test_billing_header_line_is_removed_so_prompts_share_a_prefix(chatml):
    normalize = stage(chatml)
    first, second = run(normalize, claude_code_turn(BILLING_1, "a")), run(normalize, claude_code_turn(BILLING_2, "b"))
    assert first[0] == second[0] == {"role": "system", "content": "\n".join(CLAUDE_SYSTEM)}
    assert first[1] == {"role": "user", "content": "a"}
    render = [chatml.apply_chat_template(m, tokenize=False) for m in (first, second)]
    shared = os.path.commonprefix(render)
    assert render[0][len(shared):].startswith("a") and CLAUDE_SYSTEM[1] in shared and "billing" not in shared


def test_billing_header_only_leading_system_lines(chatml):
    normalize = stage(chatml)
    untouched = [
        {"role": "system", "content": "Be brief.\n" + BILLING_1},      # not at the start
        {"role": "user", "content": BILLING_1 + "\nhello"},             # not a system message
        {"role": "system", "content": "x-anthropic-billing-header"},    # no colon: not the header line
    ]
    assert run(normalize, untouched) == untouched
    assert run(normalize, [{"role": "developer", "content": BILLING_1}]) == [{"role": "system", "content": ""}]


def test_billing_header_kept_when_turned_off(chatml):
    normalize = stage(chatml, canonicalize_billing_header=False)
    messages = run(normalize, claude_code_turn(BILLING_1, "a"))
    assert messages[0]["content"] == "\n".join((BILLING_1, *CLAUDE_SYSTEM))
