"""Vision-language models served end to end: each family answers text and image requests (streamed too), the
prefix cache keys images by their bytes, the feature cache spares the vision tower, and the conversation renders
whole."""

from __future__ import annotations

import re

import pytest

from tests.helpers import app_client, sse_events, streamed_text, write_config
from tests.vision_helpers import chat_body, user_with_images

FAMILIES = ["qwen2_5_vl", "qwen3_vl", "gemma3", "idefics3"]
SYSTEM = {"role": "system", "content": "You are a careful assistant who describes pictures."}
# The tiny models' image prompts are short: a cached state of 32 tokens or more is reused (the default, 64, would
# leave these conversations cold).
MIN_32 = "[engine]\nprefix_cache_min_tokens = 32\n"


def chat(client, messages, **extra):
    response = client.post("/v1/chat/completions", json=chat_body(messages, **extra))
    assert response.status_code == 200, response.text
    return response.json()


def vision_status(client) -> dict:
    return client.get("/v1/status").json()["vision"]


@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_serves_text_and_images_and_streams(family, tiny_vlm, tmp_path):
    with app_client(write_config(tmp_path, tiny_vlm(family))) as (client, _):
        warmed = vision_status(client)["num_vision_calls"]
        assert warmed == 1  # the start-up's warm-up image (mlxd.pipeline.image_warmup)
        text = chat(client, [{"role": "user", "content": "Hello there"}])
        assert text["usage"]["completion_tokens"] == 8
        assert vision_status(client)["num_vision_calls"] == warmed  # text requests never touch the vision tower

        plain = chat(client, [{"role": "user", "content": "Describe it."}])
        seen = chat(client, [user_with_images("Describe it.", 1)])
        # Image tokens count as prompt tokens; the image changes what the model says.
        assert seen["usage"]["prompt_tokens"] > plain["usage"]["prompt_tokens"]
        assert vision_status(client)["num_vision_calls"] == warmed + 1

        response = client.post("/v1/chat/completions",
                               json=chat_body([user_with_images("Describe it.", 1)], stream=True))
        assert response.status_code == 200
        frames = sse_events(response.text)
        assert streamed_text(frames) == seen["choices"][0]["message"]["content"]


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_images_are_cached_by_their_bytes(family, tiny_vlm, tmp_path):
    with app_client(write_config(tmp_path, tiny_vlm(family), extra=MIN_32)) as (client, daemon):
        warmed = vision_status(client)["num_vision_calls"]
        first = chat(client, [SYSTEM, user_with_images("What is this?", 1)])
        calls = vision_status(client)["num_vision_calls"]
        assert calls == warmed + 1

        # The same image re-sent: a prefix-cache hit, the same answer, no vision-tower run.
        again = chat(client, [SYSTEM, user_with_images("What is this?", 1)])
        assert again["choices"][0]["message"]["content"] == first["choices"][0]["message"]["content"]
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == again["usage"]["prompt_tokens"] - 1
        assert vision_status(client)["num_vision_calls"] == calls

        # After another system prompt the prefix cache misses, but the feature cache still serves the image.
        other = chat(client, [{"role": "system", "content": "Be brief."}, user_with_images("What is this?", 1)])
        assert other["usage"]["prompt_tokens_details"]["cached_tokens"] < 8
        assert vision_status(client)["num_vision_calls"] == calls

        # Another image behind the same placeholder tokens: the cached state stops where the image starts, and the
        # answer is the one a cold cache gives.
        swapped = chat(client, [SYSTEM, user_with_images("What is this?", 2)])
        client.delete("/v1/cache").raise_for_status()
        cold = chat(client, [SYSTEM, user_with_images("What is this?", 2)])
        assert swapped["choices"][0]["message"]["content"] == cold["choices"][0]["message"]["content"]
        span_start = _first_image_position(daemon, [SYSTEM, user_with_images("What is this?", 2)])
        assert swapped["usage"]["prompt_tokens_details"]["cached_tokens"] <= span_start


def _first_image_position(daemon, messages) -> int:
    """Where the first image's placeholders start in the rendered prompt (from the daemon's own pipeline)."""
    from mlxd.pipeline.job import Job

    job = daemon.pipeline.prepare(Job(request_id="probe", model="tiny", messages=messages))
    return job.media.spans[0][0]


def test_a_conversation_with_two_images_renders_whole_and_in_order(tiny_vlm, tmp_path):
    from mlxd.pipeline.job import Job

    turns = [
        SYSTEM,
        user_with_images("First picture: what is it?", 1),
        {"role": "assistant", "content": "A red square."},
        user_with_images("And the second one?", 2),
        {"role": "assistant", "content": "A blue circle."},
        {"role": "user", "content": "Which did you like more?"},
    ]
    with app_client(write_config(tmp_path, tiny_vlm("qwen2_5_vl"))) as (client, daemon):
        job = daemon.pipeline.prepare(Job(request_id="r", model="tiny", messages=turns))
        text = job.prompt_text
        pieces = [SYSTEM["content"], "<|image_pad|>", "First picture", "A red square.", "<|image_pad|>",
                  "And the second one?", "A blue circle.", "Which did you like more?"]
        positions = [text.index(p, text.index(pieces[i - 1]) + 1 if i else 0) for i, p in enumerate(pieces)]
        assert positions == sorted(positions)
        assert job.route == "vision" and len(job.media.spans) == 2
        first, second = job.media.spans
        assert first[1] <= second[0] and job.media.digests[0] != job.media.digests[1]
        # Both images' placeholder tokens are in the prompt, each span a run of the image token.
        image_token = daemon.model_info.image_token_id
        assert all(job.prompt_ids[i] == image_token for start, end in job.media.spans for i in range(start, end))


def test_bad_images_are_400s_that_name_the_part(tiny_vlm, tiny_model_dir, tmp_path):
    config = write_config(tmp_path, tiny_vlm("qwen2_5_vl"), extra="[vision]\nmax_images = 2\nmax_image_bytes = 65536\n")
    broken = {"type": "image_url", "image_url": {"url": "data:image/png;base64,bm90IGFuIGltYWdl"}}
    video = {"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}}
    huge = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + "A" * 200_000}}
    remote = {"type": "image_url", "image_url": {"url": "http://169.254.169.254/latest/meta-data"}}
    cases = {
        "undecodable": [SYSTEM, {"role": "user", "content": [{"type": "text", "text": "hi"}, broken]}],
        "video": [SYSTEM, {"role": "user", "content": [{"type": "text", "text": "hi"}, video]}],
        "oversized": [SYSTEM, {"role": "user", "content": [{"type": "text", "text": "hi"}, huge]}],
        "too many": [SYSTEM, user_with_images("a", 1, 2), {"role": "assistant", "content": "b"},
                     {"role": "user", "content": [{"type": "text", "text": "c"}, *user_with_images("", 3)["content"]]}],
        "remote off": [SYSTEM, {"role": "user", "content": [{"type": "text", "text": "hi"}, remote]}],
    }
    expected = {"undecodable": "messages[1].content[1]", "video": "messages[1].content[1]",
                "oversized": "messages[1].content[1]", "too many": "messages[3].content[1]",
                "remote off": "messages[1].content[1]"}
    with app_client(config) as (client, _):
        for name, messages in cases.items():
            response = client.post("/v1/chat/completions", json=chat_body(messages))
            assert response.status_code == 400, (name, response.text)
            assert response.json()["error"]["param"] == expected[name], (name, response.json())
        assert chat(client, [user_with_images("still serving", 1)])["usage"]["completion_tokens"] == 8
    text_config = tmp_path / "text"
    text_config.mkdir()
    with app_client(write_config(text_config, tiny_model_dir)) as (client, _):
        messages = [SYSTEM, {"role": "user", "content": [{"type": "text", "text": "hi"}, *user_with_images("", 1)["content"]]}]
        response = client.post("/v1/chat/completions", json=chat_body(messages))
        assert response.status_code == 400 and response.json()["error"]["param"] == "messages[1].content[1]"


def test_anthropic_and_responses_images_answer_as_the_chat_route_does(tiny_vlm, tmp_path):
    """An Anthropic base64 ``image`` block and a Responses ``input_image`` reach the vision model as the chat
    route's image part does: the same prompt tokens and the same greedy answer."""
    import base64

    from tests.vision_helpers import data_uri, png

    image = png(3)
    with app_client(write_config(tmp_path, tiny_vlm("qwen2_5_vl"))) as (client, _):
        seen = chat(client, [user_with_images("Describe it.", 3)])
        anthropic = client.post("/v1/messages", json={
            "model": "tiny", "max_tokens": 8, "temperature": 0, "messages": [{"role": "user", "content": [
                {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                             "data": base64.b64encode(image).decode()}},
                {"type": "text", "text": "Describe it."}]}]})
        assert anthropic.status_code == 200, anthropic.text
        message = anthropic.json()
        assert message["content"][0]["text"] == seen["choices"][0]["message"]["content"]
        usage = message["usage"]
        assert usage["input_tokens"] + usage["cache_read_input_tokens"] == seen["usage"]["prompt_tokens"]
        responses = client.post("/v1/responses", json={
            "model": "tiny", "max_output_tokens": 8, "temperature": 0, "input": [{"role": "user", "content": [
                {"type": "input_image", "image_url": data_uri(image)},
                {"type": "input_text", "text": "Describe it."}]}]})
        assert responses.status_code == 200, responses.text
        body = responses.json()
        text = "".join(part["text"] for item in body["output"] if item["type"] == "message"
                       for part in item["content"])
        assert text == seen["choices"][0]["message"]["content"].strip()
        assert body["usage"]["input_tokens"] == seen["usage"]["prompt_tokens"]


@pytest.mark.parametrize(("sizes", "expected"), [("[]", 0), ("[32, 96]", 2)])
def test_warm_up_sends_one_image_of_each_configured_size(tiny_vlm, tmp_path, capsys, sizes, expected):
    extra = f"[vision]\nwarm_up_image_sizes = {sizes}\n{MIN_32}"
    with app_client(write_config(tmp_path, tiny_vlm("qwen2_5_vl"), extra=extra)) as (client, _):
        assert vision_status(client)["num_vision_calls"] == expected
    logged = [line for line in capsys.readouterr().out.splitlines() if "image_warm_up " in line]
    assert len(logged) == expected and all(f"size={n}" in "".join(logged) for n in sizes.strip("[]").split(", ") if n)
    # Each size's second turn starts from the first turn's cached state (a vision row continuing from the prefix
    # cache), and finds the image in the feature cache: one tower run per size.
    cached = [int(re.search(r"turn_2_cached_tokens=(\d+)", line).group(1)) for line in logged]
    assert all(n >= 32 for n in cached), logged


def test_a_config_that_refuses_images_still_starts_and_serves_text(tiny_vlm, tmp_path, capsys):
    # The start-up's warm-up image is refused like a user's would be: logged, and text is still served.
    with app_client(write_config(tmp_path, tiny_vlm("qwen2_5_vl"), extra="[vision]\nmax_images = 0\n")) as (client, _):
        assert vision_status(client)["num_vision_calls"] == 0
        assert chat(client, [{"role": "user", "content": "Hello there"}])["usage"]["completion_tokens"] == 8
    assert "image_warm_up_failed" in capsys.readouterr().out
