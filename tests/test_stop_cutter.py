"""Stop sequences are cut exactly, however the text is split into segments."""

from __future__ import annotations

import random
import time

import msgspec
import pytest

from mlxd.api import anthropic_jobs, jobs
from mlxd.api.anthropic_schemas import MessagesRequest
from mlxd.api.schemas import ChatCompletionRequest
from mlxd.config.schema import SamplingDefaults
from mlxd.errors import RequestError
from mlxd.pipeline.stages.detokenize import StopCutter
from mlxd.pipeline.stops import MAX_STOP_CHARS, MAX_STOPS, check_stops


def run(stops: list[str], segments: list[str]) -> tuple[str, bool]:
    cutter = StopCutter(stops)
    out = []
    for segment in segments:
        text, stopped = cutter.feed(segment)
        out.append(text)
        if stopped:
            return "".join(out), True
    return "".join(out) + cutter.flush(), False


def reference(stops: list[str], text: str) -> tuple[str, bool]:
    hits = [text.find(s) for s in stops if s and s in text]
    return (text[: min(hits)], True) if hits else (text, False)


@pytest.mark.parametrize("seed", range(200))
def test_random_splits_match_reference(seed):
    rng = random.Random(seed)
    alphabet = "ab c\n"
    text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40)))
    stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 3))]
    cuts = sorted(rng.sample(range(len(text) + 1), k=min(len(text) + 1, rng.randint(0, 10))))
    segments = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    assert run(stops, segments) == reference(stops, text)


def test_text_that_may_start_a_stop_is_held_back():
    cutter = StopCutter(["</end>"])
    assert cutter.feed("hello </e") == ("hello ", None)
    assert cutter.feed("nd> more") == ("", "</end>")


def test_held_back_text_is_released_when_it_diverges():
    cutter = StopCutter(["</end>"])
    assert cutter.feed("a </e") == ("a ", None)
    assert cutter.feed("x") == ("</ex", None)


@pytest.mark.parametrize("seed", range(300))
def test_self_overlapping_stops_match_reference(seed):
    # Stops that overlap themselves ("aab", "abab") exercise the failure table: text held back must restart a match
    # part-way, not from scratch.
    rng = random.Random(1000 + seed)
    text = "".join(rng.choice("ab") for _ in range(rng.randint(0, 60)))
    stops = ["".join(rng.choice("ab") for _ in range(rng.randint(2, 6))) for _ in range(rng.randint(1, 3))]
    cuts = sorted(rng.sample(range(len(text) + 1), k=min(len(text) + 1, rng.randint(0, 20))))
    segments = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    out, stopped = run(stops, segments)
    expected, expected_stopped = reference(stops, text)
    assert stopped == expected_stopped
    # Across segments the stop that completes first wins, which may start after the reference's (earliest) cut,
    # never before it.
    assert out.startswith(expected) if stopped else out == expected


@pytest.mark.parametrize("kind", ["begun", "never begun"])
def test_cost_does_not_grow_with_the_text_or_the_stops(kind):
    """16 stops of the longest allowed length over 20,000 pieces of text: stops the text keeps beginning (a match
    restarts part-way through the stop at every piece), and stops it never begins though it holds their characters
    (a cutter that tried every prefix of every stop per piece took 8.6 s for 2,000 of these pieces): a few tenths of
    a second in all, and later pieces cost no more than early ones."""
    if kind == "begun":
        stops = [("ab" * MAX_STOP_CHARS)[: MAX_STOP_CHARS - 1] + str(i % 10) for i in range(MAX_STOPS)]
    else:
        stops = ["b" * (MAX_STOP_CHARS - 1) + str(i % 10) for i in range(MAX_STOPS)]
    cutter = StopCutter(stops)
    piece = "abab"
    times = []
    for _ in range(20):
        start = time.perf_counter()
        for _ in range(1000):
            text, stop = cutter.feed(piece)
            assert stop is None
        times.append(time.perf_counter() - start)
    assert sum(times) < 5.0, times
    # Medians, so that a scheduling hiccup on a busy machine does not decide; a quadratic cutter's later thousands
    # cost many times its first ones.
    assert sorted(times[10:])[5] < 4 * max(sorted(times[:10])[5], 0.005), times


def test_check_stops_bounds_count_and_length():
    assert check_stops(["a", "", "b"], "stop") == ["a", "b"]
    assert check_stops(["x" * MAX_STOP_CHARS] * MAX_STOPS, "stop") == ["x" * MAX_STOP_CHARS] * MAX_STOPS
    with pytest.raises(RequestError) as e:
        check_stops(["a"] * (MAX_STOPS + 1), "stop_sequences")
    assert e.value.param == "stop_sequences" and str(MAX_STOPS) in e.value.message
    with pytest.raises(RequestError) as e:
        check_stops(["a", "x" * (MAX_STOP_CHARS + 1)], "stop")
    assert e.value.param == "stop" and "stop sequence 1" in e.value.message


@pytest.mark.parametrize("stops", [["x" * (MAX_STOP_CHARS + 1)], [str(i) for i in range(MAX_STOPS + 1)]])
def test_both_surfaces_refuse_stops_beyond_the_bounds_naming_the_field(stops):
    openai = msgspec.convert({"model": "m", "messages": [{"role": "user", "content": "hi"}], "stop": stops},
                             ChatCompletionRequest)
    with pytest.raises(RequestError) as caught:
        jobs.chat_job(openai, "m", SamplingDefaults())
    assert caught.value.param == "stop"
    anthropic = msgspec.convert({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}],
                                 "stop_sequences": stops}, MessagesRequest)
    with pytest.raises(RequestError) as caught:
        anthropic_jobs.messages_job(anthropic, "m", SamplingDefaults())
    assert caught.value.param == "stop_sequences"
