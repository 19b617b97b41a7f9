"""The byte-level streaming detokenizer gives mlx-lm's BPE detokenizer's text, segment for segment (the oracle):
on the tiny test tokenizer's whole vocabulary in random orders, and on crafted vocabularies that split characters
across tokens, hold lone spaces, and carry invalid bytes and ids past the vocabulary."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, NaiveStreamingDetokenizer
from mlx_lm.tokenizer_utils import load as load_tokenizer

from mlxd.pipeline.detokenizer import ByteLevelDetokenizer, MlxLmText, bytes_to_unicode, make_detokenizer
from tests.support.tiny import build_tokenizer

BYTE = bytes_to_unicode()


def _spell(data: bytes) -> str:
    """A byte-level vocabulary's spelling of ``data``."""
    return "".join(BYTE[b] for b in data)


class _Vocabulary:
    """What mlx-lm's BPE detokenizer reads from a tokenizer: its length and each id's token string."""

    def __init__(self, pieces: list[str]) -> None:
        self.pieces = pieces

    def __len__(self) -> int:
        return len(self.pieces)

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        return [self.pieces[i] for i in ids]


class _Wrapper:
    """A tokenizer wrapper whose ``detokenizer`` is mlx-lm's BPE one over ``pieces``."""

    def __init__(self, pieces: list[str]) -> None:
        self.vocabulary = _Vocabulary(pieces)

    @property
    def detokenizer(self) -> BPEStreamingDetokenizer:
        return BPEStreamingDetokenizer(self.vocabulary)


def _segments_of_mlx_lm(pieces: list[str], ids: list[int]) -> list[str]:
    detokenizer = BPEStreamingDetokenizer(_Vocabulary(pieces))
    out = []
    for token in ids:
        detokenizer.add_token(token)
        out.append(detokenizer.last_segment)
    detokenizer.finalize()
    return [*out, detokenizer.last_segment]


def _segments(factory, ids: list[int]) -> list[str]:
    detokenizer = factory()
    return [*(detokenizer.add(token) for token in ids), detokenizer.finish()]


@pytest.fixture(scope="module")
def tiny_tokenizer(tmp_path_factory: pytest.TempPathFactory):
    folder = tmp_path_factory.mktemp("tokenizer")
    build_tokenizer(Path(folder))
    return load_tokenizer(Path(folder))


def test_the_tiny_tokenizers_vocabulary_in_random_orders(tiny_tokenizer) -> None:
    factory = make_detokenizer(tiny_tokenizer)
    assert isinstance(factory(), ByteLevelDetokenizer)
    pieces = tiny_tokenizer.detokenizer.tokenmap
    rng = random.Random(7)
    for _ in range(200):
        ids = [rng.randrange(len(pieces)) for _ in range(rng.randrange(1, 40))]
        assert _segments(factory, ids) == _segments_of_mlx_lm(pieces, ids), ids


def test_text_with_multibyte_characters_streams_as_mlx_lm_streams_it(tiny_tokenizer) -> None:
    factory = make_detokenizer(tiny_tokenizer)
    pieces = tiny_tokenizer.detokenizer.tokenmap
    for text in [" héllo wörld, 日本語 and 🙂🙂 ", "  two  spaces\n\tand a tab", "naïve café", " "]:
        ids = tiny_tokenizer.encode(text, add_special_tokens=False)
        segments = _segments(factory, ids)
        assert segments == _segments_of_mlx_lm(pieces, ids)
        assert "".join(segments) == (text[1:] if text.startswith(" ") else text)


CRAFTED = [
    _spell(b"a"), _spell(b" "), _spell(b" b"), _spell("é".encode()[:1]), _spell("é".encode()[1:]),
    _spell("🙂".encode()[:2]), _spell("🙂".encode()[2:]), _spell(b"\xff"), _spell(b"\x80x"), "<|im_end|>",
    BYTE[0], _spell(b"\n"), "Ā" + _spell(b"z"), "日本",
]


@pytest.mark.parametrize("ids", [
    [1, 0],  # a lone space is held until the next token, then the first text's leading space goes
    [1, 1, 1, 0],
    [2, 1, 2],  # the first text loses its leading space; later ones keep theirs
    [3, 4, 5, 6],  # characters split across tokens are held until complete
    [3, 1, 4, 0],
    [5, 3, 4, 6],  # an invalid sequence in the middle
    [7, 0, 8, 0],  # invalid bytes: held while the text ends with U+FFFD, then passed on replaced
    [9, 10, 11, 12, 13],  # an added token; the alphabet's character for byte 0, read as mlx-lm reads it
    [0, 99, 0],  # an id past the vocabulary
    [3],  # held to the end: the end flushes it
    [1],
    [],
])
def test_crafted_vocabulary(ids: list[int]) -> None:
    factory = make_detokenizer(_Wrapper(CRAFTED))
    assert _segments(factory, ids) == _segments_of_mlx_lm(CRAFTED, ids)


def test_other_detokenizers_are_mlx_lms_own(tiny_tokenizer) -> None:
    class Naive:
        @property
        def detokenizer(self) -> NaiveStreamingDetokenizer:
            return NaiveStreamingDetokenizer(tiny_tokenizer)

    factory = make_detokenizer(Naive())
    detokenizer = factory()
    assert isinstance(detokenizer, MlxLmText)
    ids = tiny_tokenizer.encode("Hello there\nsecond line", add_special_tokens=False)
    assert "".join(_segments(factory, ids)) == "Hello there\nsecond line"


def test_the_stage_module_imports_no_mlx() -> None:
    import subprocess
    import sys

    code = "import sys, mlxd.pipeline.stages.detokenize; sys.exit('mlx.core' in sys.modules or 'mlx_lm' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0
