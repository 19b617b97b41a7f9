"""Stage order: each stage declares the Job fields it needs and provides, and a pipeline whose stage reads a field no
earlier stage provides fails at start-up and in check-config, naming the pipeline file, the stage and the field."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from mlxd.cli import load_everything
from mlxd.engine.base import Plain, Speculative
from mlxd.errors import ConfigError, PipelineError
from mlxd.pipeline.job import JOB_FIELDS, REQUEST_FIELDS, ChunkPlan, Job
from mlxd.pipeline.pipeline import declared
from mlxd.pipeline.registry import BUILTIN_STAGES, resolve_stage
from mlxd.pipeline.stage import NoOptions, Stage

ROOT = Path(__file__).resolve().parent.parent
CHAT = ["normalize", "template", "route", "prefill", "decode", "detokenize", "parse"]


class Summarize(Stage):
    """A third-party stage that reads what the chat template rendered."""

    Config = NoOptions
    needs = frozenset({"prompt_text"})


class Misspelled(Stage):
    Config = NoOptions
    needs = frozenset({"prompt_tokens"})


def write_pipeline(tmp_path: Path, names: list[str]) -> Path:
    """A config beside its own pipeline file (pipelines/order.toml) with the stages ``names``, in that order."""
    (tmp_path / "pipelines").mkdir(exist_ok=True)
    (tmp_path / "pipelines" / "order.toml").write_text("".join(f'[[stages]]\ntype = "{n}"\n\n' for n in names))
    config = tmp_path / "mlxd.toml"
    config.write_text('pipeline = "order"\n[model]\nsource = "x"\n')
    return config


def load_error(config: Path) -> str:
    with pytest.raises(ConfigError) as info:
        load_everything(config)
    return info.value.message


def test_the_shipped_pipelines_are_in_order(tmp_path):
    for config in sorted((ROOT / "configs").glob("*.toml")):
        load_everything(config)
    for pipeline in sorted((ROOT / "pipelines").glob("*.toml")):
        config = tmp_path / "mlxd.toml"
        config.write_text(f'pipeline = "{pipeline}"\n[model]\nsource = "x"\n')
        _, built = load_everything(config)
        assert [name for name, _ in built.stages] == CHAT


def test_route_before_template_names_file_stage_and_field(tmp_path):
    config = write_pipeline(tmp_path, ["normalize", "route", "template", "prefill", "decode", "detokenize"])
    message = load_error(config)
    assert str(tmp_path / "pipelines" / "order.toml") in message
    assert "stage 1 (route)" in message and "Job.media" in message
    assert "stage 2 (template) provides Job.media" in message


def test_decode_before_prefill_is_refused(tmp_path):
    message = load_error(write_pipeline(tmp_path, ["normalize", "template", "route", "decode", "prefill"]))
    assert "stage 3 (decode)" in message and "Job.chunk_plan" in message and "stage 4 (prefill)" in message


def test_parse_before_decode_is_refused(tmp_path):
    message = load_error(write_pipeline(tmp_path, ["template", "route", "prefill", "parse", "decode", "detokenize"]))
    assert "stage 3 (parse)" in message and "Job.engine_request" in message


def test_a_field_no_stage_provides_says_so(tmp_path):
    message = load_error(write_pipeline(tmp_path, ["normalize", "route"]))
    assert "stage 1 (route)" in message and "Job.media" in message and "no stage of this pipeline provides Job.media" in message


def test_third_party_stages_are_checked_like_built_ins(tmp_path):
    early = write_pipeline(tmp_path, ["normalize", f"{__name__}:Summarize", "template"])
    message = load_error(early)
    assert f"stage 1 ({__name__}:Summarize)" in message and "Job.prompt_text" in message
    _, built = load_everything(write_pipeline(tmp_path, [*CHAT, f"{__name__}:Summarize"]))
    assert built.stages[-1][0] == f"{__name__}:Summarize"


def test_a_declared_field_that_is_not_a_job_field_is_a_config_error(tmp_path):
    message = load_error(write_pipeline(tmp_path, [*CHAT, f"{__name__}:Misspelled"]))
    assert f"stage 7 ({__name__}:Misspelled)" in message and "prompt_tokens" in message and "prompt_ids" in message


def test_check_config_reports_the_stage_the_field_and_the_file(tmp_path):
    config = write_pipeline(tmp_path, ["normalize", "template", "prefill", "decode", "route", "detokenize", "parse"])
    result = subprocess.run([sys.executable, "-m", "mlxd", "check-config", str(config)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert str(tmp_path / "pipelines" / "order.toml") in result.stderr
    assert "stage 3 (decode)" in result.stderr and "Job.route" in result.stderr and "Job.decode" in result.stderr
    assert "stage 4 (route) provides Job.route" in result.stderr


def test_check_config_shows_what_each_stage_needs_and_provides(capsys):
    from mlxd.cli import main

    assert main(["check-config", str(ROOT / "configs" / "default.toml")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert any("needs chunk_plan, decode, media, prompt_ids, prompt_text, route; provides engine_request" in line
               for line in lines)


def test_serving_refuses_a_misordered_pipeline_before_binding_the_port(tmp_path):
    config = write_pipeline(tmp_path, ["template", "normalize", "detokenize", "decode", "prefill", "route"])
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    result = subprocess.run([sys.executable, "-m", "mlxd", "--config", str(config), "--port", str(port)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert "order.toml: stage 3 (decode)" in result.stderr and "Job.chunk_plan" in result.stderr
    with socket.socket() as free:  # nothing was listening: the port is still free
        free.bind(("127.0.0.1", port))


@pytest.mark.parametrize("name", sorted(BUILTIN_STAGES))
def test_built_in_declarations_name_job_fields(name):
    cls = resolve_stage(name)
    assert declared(cls, "needs") <= JOB_FIELDS and declared(cls, "provides") <= JOB_FIELDS
    assert not declared(cls, "provides") & (REQUEST_FIELDS - {"messages"})  # only normalize rewrites a request field


# What the stages provide is what the next ones act on.

def _warm(name: str, config_text: str = "", context_length: int = 64):
    import tomllib

    from mlxd.config.load import convert
    from mlxd.config.schema import DaemonConfig
    from mlxd.pipeline.stage import ModelInfo, PipelineContext

    config = convert(tomllib.loads('[model]\nsource = "x"\n' + config_text), DaemonConfig, "test")
    stage = resolve_stage(name)(resolve_stage(name).Config())
    model = ModelInfo(name="m", context_length=context_length, eos_token_ids=frozenset({0}),
                      special_token_ids=frozenset())
    stage.warm_up(PipelineContext(config, model, tokenizer=None, engine=None))
    return stage


def test_the_chunk_plan_is_the_prefill_stages_and_the_engine_request_carries_it():
    prefill = _warm("prefill", "[engine]\nprefill_chunk = 16\n")
    decode = _warm("decode")
    job = Job(request_id="r", model="m", prompt_ids=list(range(1, 41)), checkpoints=(30,), max_tokens=8,
              route="text", decode=Plain(reason="no drafter configured"))
    prefill.prepare(job)
    assert job.chunk_plan == ChunkPlan(chunk_tokens=16, checkpoints=(30,), max_tokens=8)
    decode.prepare(job)
    request = job.engine_request
    assert (request.prefill_chunk, request.checkpoints, request.max_tokens) == (16, (30,), 8)
    assert request.prompt == job.prompt_ids and request.route == "text" and request.decode == job.decode


def test_the_route_decision_travels_on_the_engine_request():
    from mlxd.engine.base import Media

    route = _warm("route", '[engine.speculative]\ndrafter = "prompt_lookup"\ndefault = true\n')
    prefill, decode = _warm("prefill"), _warm("decode")
    media = Media(digests=("ab" * 32,), spans=((1, 3),), inputs={})
    text = Job(request_id="t", model="m", prompt_ids=[5, 6, 7, 8])
    vision = Job(request_id="v", model="m", prompt_ids=[5, 9, 9, 8], media=media)
    for job in (text, vision):
        route.prepare(job)
        prefill.prepare(job)
        decode.prepare(job)
    assert (text.engine_request.route, vision.engine_request.route) == ("text", "vision")
    assert isinstance(text.engine_request.decode, Speculative) and text.engine_request.media is None
    assert vision.engine_request.decode == Plain(reason="requests with images decode plain")
    assert vision.engine_request.media is media


def test_images_on_a_text_route_are_refused_not_dropped():
    from mlxd.engine.base import Media

    prefill, decode = _warm("prefill"), _warm("decode")
    job = Job(request_id="x", model="m", prompt_ids=[1, 2, 3], route="text",
              media=Media(digests=("cd" * 32,), spans=((1, 2),), inputs={}))
    prefill.prepare(job)
    with pytest.raises(PipelineError, match="'text' was chosen for a request with images"):
        decode.prepare(job)


@pytest.mark.parametrize(("tools", "tool_choice", "response_format", "forced"), [
    (None, None, None, None),
    ([{"type": "function", "function": {"name": "f"}}], "auto", None, None),
    ([{"type": "function", "function": {"name": "f"}}], "required", None, "tool_choice"),
    ([{"type": "function", "function": {"name": "f"}}], {"type": "function", "function": {"name": "f"}}, None,
     "tool_choice"),
    (None, "required", None, None),  # no tools: nothing to force (the API refuses this before)
    (None, None, {"type": "json_object"}, "response_format"),
    ([{"type": "function", "function": {"name": "f"}}], "required", {"type": "json_object"}, "tool_choice"),
])
def test_forced_output_is_one_rule(tools, tool_choice, response_format, forced):
    job = Job(request_id="r", model="m", tools=tools, tool_choice=tool_choice, response_format=response_format)
    assert job.forced_output() == forced


@pytest.mark.parametrize(("fields", "param"), [
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required"}, "tool_choice"),
])
def test_forced_output_without_a_parse_stage_is_refused_naming_the_field(fields, param):
    import asyncio

    from mlxd.errors import RequestError

    prefill, decode = _warm("prefill"), _warm("decode")
    job = Job(request_id="r", model="m", prompt_ids=[1, 2, 3], route="text", **fields)
    prefill.prepare(job)
    decode.prepare(job)

    async def nothing():
        return
        yield

    async def drain():
        async for _ in decode.stream(job, nothing()):
            pass

    with pytest.raises(RequestError) as info:
        asyncio.run(drain())
    assert info.value.param == param and "no `parse` stage" in info.value.message


# The declarations are honest: what each built-in stage's prepare writes is among what it declares to provide.

def _written_by_each_stage(pipeline, job: Job) -> dict[str, set[str]]:
    written = {}
    for name, stage in pipeline.stages:
        before = {field: getattr(job, field) for field in JOB_FIELDS}
        stage.prepare(job)
        written[name] = {field for field in JOB_FIELDS if getattr(job, field) is not before[field]}
    return written


def test_each_stage_writes_only_what_it_declares(tiny_model_dir, tiny_vlm, tmp_path):
    from tests.helpers import app_client, write_config
    from tests.vision_helpers import user_with_images

    text_jobs = [
        # A system prompt long enough for a snapshot where it ends (prefix_cache_min_tokens): template's checkpoints.
        Job(request_id="chat", model="tiny", messages=[{"role": "developer", "content": "Be brief. " * 20},
                                                       {"role": "user", "content": "Hello?"}]),
        Job(request_id="completion", model="tiny", prompt="Once upon a time", max_tokens=10**6,
            clamp_max_tokens=True),
    ]
    vision_jobs = [Job(request_id="image", model="tiny", messages=[user_with_images("What is it?", 3)])]
    seen: dict[str, set[str]] = {name: set() for name in CHAT}
    for model_dir, jobs in ((tiny_model_dir, text_jobs), (tiny_vlm("qwen2_5_vl"), vision_jobs)):
        (tmp_path / model_dir.name).mkdir()
        with app_client(write_config(tmp_path / model_dir.name, model_dir)) as (_, daemon):
            for job in jobs:
                for name, fields in _written_by_each_stage(daemon.pipeline, job).items():
                    stage = dict(daemon.pipeline.stages)[name]
                    assert fields <= declared(stage, "provides"), (name, job.request_id, fields)
                    seen[name] |= fields
                assert job.engine_request.route == job.route and job.engine_request.decode is job.decode
    # Every declared field was seen written by some request (none is declared for show).
    for name in CHAT:
        assert seen[name] == declared(resolve_stage(name), "provides"), name


class OneString(Stage):
    Config = NoOptions
    needs = "prompt_ids"  # a string, not a set of names


def test_a_declaration_that_is_not_a_set_of_names_is_a_config_error(tmp_path):
    message = load_error(write_pipeline(tmp_path, [*CHAT, f"{__name__}:OneString"]))
    assert f"stage 7 ({__name__}:OneString)" in message and "must be a set of Job field names" in message
