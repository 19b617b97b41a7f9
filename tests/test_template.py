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
    (boundary,) = job.checkpoints
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
