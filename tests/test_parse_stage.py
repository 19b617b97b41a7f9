"""The ``detokenize`` → ``parse`` hand-over: special tokens that mark tool calls reach the parser (and only when a
parser reads them), and the stage turns marked text into typed events with the right finish reason."""

from __future__ import annotations

import asyncio
from typing import Any

from mlx_lm.tokenizer_utils import load as load_tokenizer

from mlxd.config.load import convert
from mlxd.engine.base import Finished, Token
from mlxd.pipeline.events import ContentDelta, Done, ToolCallDelta
from mlxd.pipeline.job import Job
from mlxd.pipeline.stage import ModelInfo, PipelineContext
from mlxd.pipeline.stages.detokenize import Detokenize, DetokenizeConfig
from mlxd.pipeline.stages.parse import Parse, ParseConfig
from tests.support.tool_templates import TOOL_TEMPLATES

TOOLS = [{"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}}]


def context(tiny_model_dir) -> tuple[Any, PipelineContext]:
    tokenizer = load_tokenizer(tiny_model_dir)
    tokenizer.chat_template = TOOL_TEMPLATES["qwen3"]
    # As in models whose call markers are special tokens (Qwen's are added tokens): detokenize drops specials.
    marks = frozenset(tokenizer.convert_tokens_to_ids(m) for m in ("<tool_call>", "</tool_call>"))
    info = ModelInfo("tiny", 4096, frozenset(tokenizer.eos_token_ids), marks | frozenset(tokenizer.eos_token_ids),
                     vocab_size=1000)
    return tokenizer, PipelineContext(None, info, tokenizer, None)


async def run(stages: list, job: Job, tokens: list[int]) -> list:
    async def engine():
        for token in tokens:
            yield Token(token)
        yield Finished(reason="stop", num_prompt_tokens=0)

    events = engine()
    for stage in stages:
        events = stage.stream(job, events)
    return [event async for event in events]


def test_markers_reach_the_parser_and_come_out_as_a_call(tiny_model_dir):
    tokenizer, ctx = context(tiny_model_dir)
    detokenize, parse = Detokenize(convert({}, DetokenizeConfig, "t")), Parse(convert({}, ParseConfig, "t"))
    detokenize.warm_up(ctx)
    parse.warm_up(ctx)
    text = 'Sure.<tool_call>\n{"name": "search", "arguments": {"q": 1}}\n</tool_call>'
    tokens = tokenizer.encode(text, add_special_tokens=False)
    job = Job(request_id="p", model="tiny", messages=[{"role": "user", "content": "x"}], tools=TOOLS)
    parse.prepare(job)  # no engine request: only the kept markers
    assert job.keep_token_ids == parse.keep_token_ids and len(parse.keep_token_ids) == 2
    events = asyncio.run(run([detokenize, parse], job, tokens))
    assert "".join(e.text for e in events if isinstance(e, ContentDelta)) == "Sure."
    calls = [e for e in events if isinstance(e, ToolCallDelta)]
    assert calls[0].name == "search" and "".join(c.arguments for c in calls) == '{"q": 1}'
    assert isinstance(events[-1], Done) and events[-1].finish_reason == "tool_calls"


def test_without_a_parser_reading_them_special_markers_stay_out_of_content(tiny_model_dir):
    tokenizer, ctx = context(tiny_model_dir)
    detokenize = Detokenize(convert({}, DetokenizeConfig, "t"))
    detokenize.warm_up(ctx)
    tokens = tokenizer.encode('Sure.<tool_call>{"a": 1}</tool_call>', add_special_tokens=False)
    job = Job(request_id="q", model="tiny", prompt="x")
    events = asyncio.run(run([detokenize], job, tokens))
    assert "".join(e.text for e in events if isinstance(e, ContentDelta)) == 'Sure.{"a": 1}'


def test_a_call_in_another_format_is_recovered_through_the_stage(tiny_model_dir):
    """The stage feeds the configured parser (Qwen3-Coder's XML here) and recovers a Hermes JSON call from what it
    leaves as content, as FallbackToolParser does on its own: same content, same call, finish reason tool_calls."""
    from mlxd.pipeline.parsers.registry import tool_parser_for
    from mlxd.pipeline.parsers.tools.fallback import FallbackToolParser

    _, ctx = context(tiny_model_dir)
    parse = Parse(convert({"tool_parser": "qwen3_coder", "reasoning_parser": "none"}, ParseConfig, "t"))
    parse.warm_up(ctx)
    text = 'Let me look.\n<tool_call>\n{"name": "search", "arguments": {"q": "mlx"}}\n</tool_call>'
    job = Job(request_id="f", model="tiny", messages=[{"role": "user", "content": "x"}], tools=TOOLS)

    async def content():
        for i in range(0, len(text), 7):
            yield ContentDelta(text[i : i + 7])
        yield Done(finish_reason="stop", num_prompt_tokens=0, num_completion_tokens=0)

    async def collect():
        return [event async for event in parse.stream(job, content())]

    events = asyncio.run(collect())
    alone = FallbackToolParser(tool_parser_for("qwen3_coder", None)(TOOLS), TOOLS)
    expected = [e for i in range(0, len(text), 7) for e in alone.feed(text[i : i + 7])] + alone.finish()

    def summary(evs):
        calls = [e for e in evs if isinstance(e, ToolCallDelta)]
        return ("".join(e.text for e in evs if isinstance(e, ContentDelta)), [c.name for c in calls if c.name],
                "".join(c.arguments for c in calls))

    assert summary(events) == summary(expected) == ("Let me look.\n", ["search"], '{"q": "mlx"}')
    assert isinstance(events[-1], Done) and events[-1].finish_reason == "tool_calls"
