"""The template stage: prompt ids, and the checkpoint at the end of the last message."""

from __future__ import annotations

from mlx_lm.tokenizer_utils import load as load_tokenizer

from mlxd.config.load import convert
from mlxd.pipeline.job import Job
from mlxd.pipeline.stage import ModelInfo, PipelineContext
from mlxd.pipeline.stages.template import Template, TemplateConfig


def test_checkpoint_is_where_the_next_turn_diverges(tiny_model_dir):
    tokenizer = load_tokenizer(tiny_model_dir)
    stage = Template(convert({}, TemplateConfig, "test"))
    stage.warm_up(PipelineContext(None, ModelInfo("tiny", 256, frozenset(), frozenset()), tokenizer, None))
    first = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "List three colours."}]
    job = Job(request_id="a", model="tiny", messages=first)
    stage.prepare(job)
    # The checkpoints: where the system prompt ends, and where the last message does.
    system_end, boundary = job.checkpoints
    system = tokenizer.apply_chat_template(first[:1], tokenize=False, add_generation_prompt=False)
    assert job.prompt_ids[:system_end] == tokenizer.encode(system, add_special_tokens=False)
    bare = tokenizer.apply_chat_template(first, tokenize=False, add_generation_prompt=False)
    assert job.prompt_ids[:boundary] == tokenizer.encode(bare, add_special_tokens=False)
    # The next turn shares exactly the tokens up to the checkpoint (and possibly more).
    second = Job(request_id="b", model="tiny", messages=[*first, {"role": "assistant", "content": "Red."},
                                                          {"role": "user", "content": "More."}])
    stage.prepare(second)
    assert second.prompt_ids[:boundary] == job.prompt_ids[:boundary]
    assert 0 < boundary < len(job.prompt_ids)


def test_completion_prompts_have_no_checkpoint(tiny_model_dir):
    tokenizer = load_tokenizer(tiny_model_dir)
    stage = Template(convert({}, TemplateConfig, "test"))
    stage.warm_up(PipelineContext(None, ModelInfo("tiny", 256, frozenset(), frozenset()), tokenizer, None))
    job = Job(request_id="c", model="tiny", prompt="Once upon a time")
    stage.prepare(job)
    assert job.checkpoints == () and job.prompt_ids == tokenizer.encode("Once upon a time")


TOOL = {"type": "function", "function": {"name": "search", "parameters": {"type": "object", "properties": {
    "query": {"type": "string"}}}}}


def staged(tiny_model_dir, chat_template: str) -> tuple[Template, object]:
    tokenizer = load_tokenizer(tiny_model_dir)
    tokenizer.chat_template = chat_template
    stage = Template(convert({}, TemplateConfig, "test"))
    stage.warm_up(PipelineContext(None, ModelInfo("tiny", 4096, frozenset(), frozenset()), tokenizer, None))
    return stage, tokenizer


def test_a_template_without_tools_gets_them_in_the_hermes_form(tiny_model_dir):
    from mlxd.pipeline.parsers.registry import tool_parser_for
    from tests.support.tool_templates import NO_TOOLS_TEMPLATE

    stage, _ = staged(tiny_model_dir, NO_TOOLS_TEMPLATE)
    call = {"id": "call_1", "type": "function", "function": {"name": "search", "arguments": {"query": "rain"}}}
    messages = [{"role": "user", "content": "Find rain."}, {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "It rains."}]
    job = Job(request_id="t", model="tiny", messages=messages, tools=[TOOL])
    stage.prepare(job)
    prompt = job.prompt_text
    assert prompt.startswith("<|im_start|>system\n# Tools") and '"name": "search"' in prompt
    assert '<tool_call>\n{"name": "search", "arguments": {"query": "rain"}}\n</tool_call>' in prompt
    assert "<|im_start|>user\n<tool_response>\nIt rains.\n</tool_response><|im_end|>" in prompt
    assert prompt.endswith("<|im_start|>assistant\n")
    assert tool_parser_for("auto", NO_TOOLS_TEMPLATE).name == "hermes"  # and the model's calls are read back so


def test_reasoning_effort_sets_the_template_s_thinking_switch(tiny_model_dir):
    from mlxd.api.jobs import chat_job
    from mlxd.api.schemas import ChatCompletionRequest
    from mlxd.config.schema import SamplingDefaults
    from tests.support.tool_templates import TOOL_TEMPLATES

    stage, _ = staged(tiny_model_dir, TOOL_TEMPLATES["qwen3"])
    rendered = {}
    for effort in ("none", "high"):
        body = ChatCompletionRequest(model="tiny", messages=[{"role": "user", "content": "Hi"}],
                                     reasoning_effort=effort)
        job = chat_job(body, "tiny", SamplingDefaults())
        stage.prepare(job)
        rendered[effort] = job.prompt_text
    assert rendered["none"].endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")  # thinking off
    assert rendered["high"].endswith("<|im_start|>assistant\n")
