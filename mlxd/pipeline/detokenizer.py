"""Streaming detokenizers for the ``detokenize`` stage: token ids in, the new text of each token out.

The stage runs on the event loop for every token of every stream, so its cost per token is taken from the engine
thread's step building (the GIL). mlx-lm's :class:`~mlx_lm.tokenizer_utils.BPEStreamingDetokenizer` (byte-level
BPE: Qwen, Llama 3, Mistral's newer tokenizers, GPT-style vocabularies) maps each character of a token through a
dictionary and re-decodes the bytes it holds, in Python, per token. :class:`ByteLevelDetokenizer` gives the same
text, segment for segment, from each token's bytes worked out once per model (:func:`make_detokenizer`), so a
token costs one ``bytes.decode``. Other tokenizers (SentencePiece, the naive fallback) keep mlx-lm's own.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

REPLACEMENT = "\ufffd"


class StreamingText(Protocol):
    """One request's detokenizer: ``add`` a token, get the text it completes (often all of it, "" while held)."""

    def add(self, token: int) -> str: ...

    def finish(self) -> str:
        """The text still held, at the end of the stream."""


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: each byte as the printable character byte-level BPE vocabularies spell it."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def make_detokenizer(tokenizer: Any) -> Callable[[], StreamingText]:
    """A factory of per-request detokenizers for ``tokenizer`` (an mlx-lm ``TokenizerWrapper``): the fast
    byte-level one where mlx-lm would use its BPE detokenizer, else mlx-lm's own behind the same interface."""
    from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer  # here: importing mlx-lm imports MLX

    probe = tokenizer.detokenizer  # a fresh instance of the tokenizer's detokenizer class
    if type(probe) is not BPEStreamingDetokenizer:
        return lambda: MlxLmText(tokenizer.detokenizer)
    table = ByteTable(probe.tokenmap)
    return lambda: ByteLevelDetokenizer(table)


class ByteTable:
    """Each token's bytes, as mlx-lm's BPE detokenizer reads them when a token is added (a character outside the
    byte alphabet, as in an added token, stands for its UTF-8 bytes; so does the alphabet's character for byte 0,
    as mlx-lm reads it), and the id of the token that is a lone space."""

    def __init__(self, tokenmap: list[str]) -> None:
        decoder = {c: b for b, c in bytes_to_unicode().items()}
        self.bytes = [_token_bytes(piece, decoder) for piece in tokenmap]
        space = bytes_to_unicode()[ord(" ")]
        self.spaces = frozenset(i for i, piece in enumerate(tokenmap) if piece == space)


def _token_bytes(piece: str, decoder: dict[str, int]) -> bytes:
    out = bytearray()
    for char in piece:
        byte = decoder.get(char, 0)
        if byte:
            out.append(byte)
        else:
            out += char.encode()
    return bytes(out)


class ByteLevelDetokenizer:
    """mlx-lm's :class:`BPEStreamingDetokenizer`, segment for segment: text is held while its bytes end inside a
    character (it would decode to U+FFFD) and while the last token is a lone space; the first text loses one
    leading space."""

    __slots__ = ("_table", "_spaces", "_held", "_started")

    def __init__(self, table: ByteTable) -> None:
        self._table, self._spaces = table.bytes, table.spaces
        self._held = b""
        self._started = False  # whether any text came out (the leading space is dropped until it has)

    def add(self, token: int) -> str:
        held = self._held + (self._table[token] if token < len(self._table) else b"!")
        text = held.decode("utf-8", "replace")
        if text.endswith(REPLACEMENT) or token in self._spaces:
            self._held = held
            return ""
        self._held = b""
        return self._trim(text)

    def finish(self) -> str:
        held, self._held = self._held, b""
        return self._trim(held.decode("utf-8", "replace"))

    def _trim(self, text: str) -> str:
        if not self._started:
            if text[:1] == " ":
                text = text[1:]
            self._started = bool(text)
        return text


class MlxLmText:
    """An mlx-lm streaming detokenizer behind :class:`StreamingText`."""

    __slots__ = ("_detokenizer",)

    def __init__(self, detokenizer: Any) -> None:
        self._detokenizer = detokenizer

    def add(self, token: int) -> str:
        self._detokenizer.add_token(token)
        return self._detokenizer.last_segment

    def finish(self) -> str:
        self._detokenizer.finalize()
        return self._detokenizer.last_segment
