"""Stop sequences are cut exactly, however the text is split into segments."""

from __future__ import annotations

import random

import pytest

from mlxd.pipeline.stages.detokenize import StopCutter


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
