"""Snapshots where agents want them: the end of the system prompt and tools, Anthropic ``cache_control``
breakpoints, OpenAI ``prompt_cache_key``; a hybrid model (its cache cannot be trimmed: it is reused only where a
snapshot was taken) then reuses exactly those prefixes, and the usage reports exactly what was reused."""

from __future__ import annotations

import msgspec
import pytest
from mlx_lm.tokenizer_utils import load as load_tokenizer

from mlxd.api.anthropic_jobs import prompt_job
from mlxd.api.anthropic_schemas import MessagesRequest
from mlxd.config.load import convert
from mlxd.pipeline.stage import ModelInfo, PipelineContext
from mlxd.pipeline.stages.template import Template, TemplateConfig
from mlxd.pipeline.stages.template_points import SharedPrefixes
from tests.helpers import app_client, write_config
from tests.support import tool_templates
from tests.support.tiny import CHAT_TEMPLATE
from tests.support.tiny_hybrid import tiny_qwen3_5_mtp_cached

SYSTEM = "You are a coding agent. " + "Follow the repository's rules, read files before editing them. " * 10
PARAMETERS = {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}
OPENAI_TOOLS = [{"type": "function", "function": {"name": "read_file", "description": "Read a file.",
                                                  "parameters": PARAMETERS}}]
ANTHROPIC_TOOLS = [{"name": "read_file", "description": "Read a file.", "input_schema": PARAMETERS,
                    "cache_control": {"type": "ephemeral"}}]
EPHEMERAL = {"type": "ephemeral"}


def block_length(model_dir) -> int:
    """Tokens of the system prompt and tool definitions, as the model's own chat template renders them alone."""
    tokenizer = load_tokenizer(model_dir)
    text = tokenizer.apply_chat_template([{"role": "system", "content": SYSTEM}], tools=OPENAI_TOOLS,
                                         tokenize=False)
    return len(tokenizer.encode(text, add_special_tokens=False))


def anthropic_body(user: str) -> dict:
    # As Claude Code sends it: a billing header block that changes with each conversation (left out of the prompt),
    # then the system prompt with a breakpoint; tools with one on the last; one on the user's text.
    header = f"x-anthropic-billing-header: cc_version=2.1.{len(user)}; cch={abs(hash(user)) % 10**6};"
    return {"model": "tiny", "tools": ANTHROPIC_TOOLS,
            "system": [{"type": "text", "text": header}, {"type": "text", "text": SYSTEM, "cache_control": EPHEMERAL}],
            "messages": [{"role": "user", "content": [{"type": "text", "text": user, "cache_control": EPHEMERAL}]}]}


def anthropic(client, user: str) -> dict:
    response = client.post("/v1/messages", json={**anthropic_body(user), "max_tokens": 6, "temperature": 0})
    assert response.status_code == 200, response.text
    return response.json()


def chat(client, messages: list[dict], **extra) -> dict:
    body = {"model": "tiny", "max_tokens": 6, "temperature": 0, "messages": messages, **extra}
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def openai(client, surface: str, user: str) -> tuple[list, int]:
    """A new conversation with the system prompt and tools on ``surface``: its output and cached prompt tokens."""
    if surface == "chat":
        body = chat(client, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}],
                    tools=OPENAI_TOOLS)
        return body["choices"], body["usage"]["prompt_tokens_details"]["cached_tokens"]
    tools = [{"type": "function", **tool["function"]} for tool in OPENAI_TOOLS]
    response = client.post("/v1/responses", json={"model": "tiny", "instructions": SYSTEM, "input": user,
                                                  "tools": tools, "temperature": 0, "max_output_tokens": 6})
    assert response.status_code == 200, response.text
    body = response.json()
    return body["output"], body["usage"]["input_tokens_details"]["cached_tokens"]


@pytest.fixture(scope="module")
def tiny_qwen3_5_dir(tiny_models_root):
    """A tiny Qwen3.5 (gated delta-net and attention layers, a vision tower: served through mlx-vlm)."""
    return tiny_qwen3_5_mtp_cached(tiny_models_root)


@pytest.mark.parametrize("model_fixture", ["tiny_qwen3_next_dir", "tiny_qwen3_5_dir"])
def test_a_new_anthropic_conversation_reuses_the_whole_system_prompt_and_tools(model_fixture, request, tmp_path):
    model_dir = request.getfixturevalue(model_fixture)
    n = block_length(model_dir)
    assert n > 64
    with app_client(write_config(tmp_path, model_dir)) as (client, _):
        first = anthropic(client, "List the files in the repository, please.")
        assert first["usage"]["cache_read_input_tokens"] == 0
        second = anthropic(client, "What does the parser in this project do?")
        assert second["usage"]["cache_read_input_tokens"] == n, second["usage"]
        client.delete("/v1/cache").raise_for_status()
        cold = anthropic(client, "What does the parser in this project do?")
        assert cold["usage"]["cache_read_input_tokens"] == 0
        assert cold["content"] == second["content"]
        assert cold["usage"]["input_tokens"] == second["usage"]["input_tokens"] + n
        # The breakpoints' markers never reach the prompt: count_tokens counts what the model ran.
        counted = client.post("/v1/messages/count_tokens", json=anthropic_body("What does the parser in this project do?"))
        assert counted.json()["input_tokens"] == cold["usage"]["input_tokens"]


@pytest.mark.parametrize("surface", ["chat", "responses"])
def test_a_new_openai_conversation_reuses_the_whole_system_prompt_and_tools(surface, tiny_qwen3_next_dir,
                                                                            tmp_path):
    n = block_length(tiny_qwen3_next_dir)
    with app_client(write_config(tmp_path, tiny_qwen3_next_dir)) as (client, _):
        assert openai(client, surface, "List the files, please.")[1] == 0
        output, cached = openai(client, surface, "Open the parser and explain it.")
        assert cached == n
        client.delete("/v1/cache").raise_for_status()
        cold_output, cold_cached = openai(client, surface, "Open the parser and explain it.")
        assert cold_cached == 0 and _without_ids(cold_output) == _without_ids(output)


def _without_ids(output: list) -> list:
    return [{k: v for k, v in item.items() if k != "id"} for item in output]


def staged(model_dir, chat_template: str | None) -> tuple[Template, object]:
    tokenizer = load_tokenizer(model_dir)
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    stage = Template(convert({}, TemplateConfig, "test"))
    stage.warm_up(PipelineContext(None, ModelInfo("tiny", 4096, frozenset(), frozenset()), tokenizer, None))
    return stage, tokenizer


BREAKPOINT_TEXTS = ("Read before you edit.", "Find the parser.", "Fix it now.")


def breakpoint_body(cache_control: dict | None) -> MessagesRequest:
    def block(text: str) -> dict:
        return {"type": "text", "text": text, **({"cache_control": cache_control} if cache_control else {})}

    tools = [{"name": "search", "input_schema": {"type": "object", "properties": {"q": {"type": "string"}},
                                                 "required": ["q"]}}]
    return msgspec.convert({
        "model": "tiny", "max_tokens": 5, "tools": tools,
        "system": [{"type": "text", "text": "You are a careful agent. "}, block(BREAKPOINT_TEXTS[0])],
        "messages": [{"role": "user", "content": [block(BREAKPOINT_TEXTS[1])]},
                     {"role": "assistant", "content": "It is in parse.py."},
                     {"role": "user", "content": [block(BREAKPOINT_TEXTS[2])]}]}, MessagesRequest)


TEMPLATES = ["QWEN3_TEMPLATE", "QWEN3_CODER_TEMPLATE", "LLAMA31_TEMPLATE", "MISTRAL_TEMPLATE", "GLM45_TEMPLATE",
             "DEEPSEEK_V31_TEMPLATE", "SEED_OSS_TEMPLATE"]


@pytest.mark.parametrize("template", [None, *TEMPLATES])
def test_cache_control_breakpoints_map_to_exact_token_offsets(template, tiny_model_dir):
    stage, tokenizer = staged(tiny_model_dir, getattr(tool_templates, template) if template else None)
    job = prompt_job(breakpoint_body(EPHEMERAL), "tiny")
    stage.prepare(job)
    plain = prompt_job(breakpoint_body(None), "tiny")
    stage.prepare(plain)
    # The markers leave no trace: the prompt is the one the same request without breakpoints renders.
    assert job.prompt_text == plain.prompt_text and job.prompt_ids == plain.prompt_ids
    assert "mlxd-cache-point" not in job.prompt_text and len(job.cache_breakpoints) == 3
    for text in BREAKPOINT_TEXTS:
        offset = job.prompt_text.index(text) + len(text)
        # The oracle: the token position whose tokens are exactly the prompt's text up to the breakpoint.
        at = [p for p in range(1, len(job.prompt_ids)) if tokenizer.decode(job.prompt_ids[:p]) ==
              job.prompt_text[:offset]]
        assert at and at[0] in job.checkpoints, (template, text, job.checkpoints)
    # Every checkpoint is a clean token boundary of the prompt text.
    for p in job.checkpoints:
        assert job.prompt_text.startswith(tokenizer.decode(job.prompt_ids[:p]))
    # Without breakpoints, only the end of the system prompt and tools and the end of the last message remain (a
    # template whose generation prompt is empty, Mistral's, has no such end).
    assert set(plain.checkpoints) < set(job.checkpoints) and 1 <= len(plain.checkpoints) <= 2


def test_the_system_block_ends_where_the_next_conversation_parts(tiny_model_dir):
    stage, tokenizer = staged(tiny_model_dir, None)
    jobs = []
    for user in ("List the files.", "Explain the parser."):
        job = prompt_job(msgspec.convert({"model": "tiny", "max_tokens": 5, "system": SYSTEM, "tools": [
            {k: v for k, v in ANTHROPIC_TOOLS[0].items() if k != "cache_control"}],
            "messages": [{"role": "user", "content": user}]}, MessagesRequest), "tiny")
        stage.prepare(job)
        jobs.append(job)
    n = block_length(tiny_model_dir)
    assert n in jobs[0].checkpoints and n in jobs[1].checkpoints
    assert jobs[0].prompt_ids[:n] == jobs[1].prompt_ids[:n]


def test_a_marker_that_changes_the_render_is_dropped_not_guessed(tiny_model_dir):
    trimming = CHAT_TEMPLATE.replace("render_content(message.content) + '<|im_end|>",
                                     "(render_content(message.content) | trim) + '<|im_end|>")
    assert trimming != CHAT_TEMPLATE
    stage, tokenizer = staged(tiny_model_dir, trimming)

    def body(cache_control: dict | None) -> MessagesRequest:
        block = {"type": "text", "text": "Trailing spaces   ", **({"cache_control": cache_control} if cache_control else {})}
        return msgspec.convert({"model": "tiny", "max_tokens": 5, "messages": [
            {"role": "user", "content": [block]}, {"role": "assistant", "content": "Yes."},
            {"role": "user", "content": "Again."}]}, MessagesRequest)

    job, plain = prompt_job(body(EPHEMERAL), "tiny"), prompt_job(body(None), "tiny")
    stage.prepare(job)
    stage.prepare(plain)
    # The marker kept the spaces from the trim: its render is not the prompt, so the breakpoint has no position.
    assert job.prompt_text == plain.prompt_text and "Trailing spaces<|im_end|>" in job.prompt_text
    assert job.checkpoints == plain.checkpoints


def test_shared_prefixes_remember_the_last_prompt_of_each_key():
    shared = SharedPrefixes(max_keys=2)
    assert shared.shared("a", [1, 2, 3, 4]) == 0
    assert shared.shared("a", [1, 2, 9]) == 2
    assert shared.shared("a", [1, 2, 9, 7]) == 3
    assert shared.shared("b", [1, 2]) == 0 and shared.shared("c", [5]) == 0
    assert shared.shared("a", [1, 2, 9]) == 0  # the least recently used key was forgotten
    bounded = SharedPrefixes(max_tokens=6)
    bounded.shared("a", [1, 2, 3, 4])
    bounded.shared("b", [1, 2, 3])  # 7 tokens held: "a" goes
    assert bounded.shared("b", [1, 2, 5]) == 2 and bounded.shared("a", [1, 2]) == 0


SHARED = "Repository notes for the session: " + "the parser reads tokens, the checker verifies types. " * 6


def key_prompt_ids(model_dir, tail: str) -> list[int]:
    tokenizer = load_tokenizer(model_dir)
    text = tokenizer.apply_chat_template([{"role": "user", "content": SHARED + tail}], tokenize=False,
                                         add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("surface", ["chat", "responses"])
def test_prompt_cache_key_snapshots_the_prefix_its_requests_share(surface, tiny_qwen3_next_dir, tmp_path):
    tails = ["Question alpha: where is main?", "Question bravo: what is the checker?", "Question charlie: why?"]
    ids = [key_prompt_ids(tiny_qwen3_next_dir, tail) for tail in tails]
    shared = next(i for i, (a, b) in enumerate(zip(ids[0], ids[1], strict=False)) if a != b)
    assert shared > 64 and ids[2][:shared] == ids[0][:shared]

    def send(client, tail: str, key: str | None) -> int:
        extra = {"prompt_cache_key": key} if key else {}
        if surface == "chat":
            return chat(client, [{"role": "user", "content": SHARED + tail}],
                        **extra)["usage"]["prompt_tokens_details"]["cached_tokens"]
        response = client.post("/v1/responses", json={"model": "tiny", "input": SHARED + tail, "temperature": 0,
                                                      "max_output_tokens": 6, **extra})
        assert response.status_code == 200, response.text
        return response.json()["usage"]["input_tokens_details"]["cached_tokens"]

    with app_client(write_config(tmp_path, tiny_qwen3_next_dir)) as (client, _):
        # Without a key, a hybrid model has no snapshot where these prompts part: nothing is reused.
        assert [send(client, tail, None) for tail in tails] == [0, 0, 0]
        client.delete("/v1/cache").raise_for_status()
        # With one: the second request snapshots where it parts from the first; the third reuses all of that.
        assert [send(client, tail, "agent-7") for tail in tails] == [0, 0, shared]


def test_cache_control_on_openai_content_parts_is_a_breakpoint(tiny_qwen3_next_dir, tmp_path):
    """Routers pass Anthropic's ``cache_control`` on in OpenAI-shaped bodies: a text part's breakpoint is where its
    text ends, and a hybrid model's next request with the same leading part reuses exactly up to there."""
    tokenizer = load_tokenizer(tiny_qwen3_next_dir)
    context = "Project context: " + "the parser reads tokens and the checker verifies types. " * 8

    def messages(question: str) -> list[dict]:
        return [{"role": "user", "content": [{"type": "text", "text": context, "cache_control": EPHEMERAL},
                                             {"type": "text", "text": question}]}]

    # The oracle: the prompt as the template renders it (normalize joins text parts with a line break), and the
    # token position whose tokens are exactly its text up to the end of the marked part.
    text = tokenizer.apply_chat_template([{"role": "user", "content": context + "\nWhat is the checker?"}],
                                         tokenize=False, add_generation_prompt=True)
    ids = tokenizer.encode(text, add_special_tokens=False)
    offset = text.index(context) + len(context)
    (expected,) = [p for p in range(1, len(ids)) if tokenizer.decode(ids[:p]) == text[:offset]]
    with app_client(write_config(tmp_path, tiny_qwen3_next_dir)) as (client, _):
        first = chat(client, messages("Where is main?"))
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        second = chat(client, messages("What is the checker?"))
        assert second["usage"]["prompt_tokens"] == len(ids)
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == expected, second["usage"]


def test_a_new_conversation_with_an_image_reuses_the_system_prompt_and_tools(tiny_qwen3_5_dir, tmp_path):
    """The image's placeholder tokens come after the block (the prompt's tokens expand them): the block's end is
    still found exactly, and a new conversation with another image reuses all of it."""
    from tests.vision_helpers import user_with_images

    n = block_length(tiny_qwen3_5_dir)
    with app_client(write_config(tmp_path, tiny_qwen3_5_dir)) as (client, _):
        for seed, cached in ((1, 0), (2, n)):
            body = chat(client, [{"role": "system", "content": SYSTEM}, user_with_images("What is it?", seed)],
                        tools=OPENAI_TOOLS)
            assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == cached, (seed, body["usage"])
