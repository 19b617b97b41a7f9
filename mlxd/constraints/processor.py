"""Grammar-constrained decoding as an mlx-lm logits processor: ``processor(tokens, logits) -> logits``.

Each row gets its own :class:`GrammarProcessor` (a copy of the grammar's matcher). On each call it feeds the
matcher the tokens sampled since its last call, asks llguidance for the allowed-token bitmask, and sets every other
logit to ``-inf``. End of sequence is the processor's business, not llguidance's: EOS ids are allowed exactly when
the grammar accepts, and once the grammar can go no further they are the only tokens allowed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import mlx.core as mx
import numpy as np
from llguidance import LLMatcher, LLTokenizer
from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

from mlxd.constraints.grammar import CompiledGrammar, GrammarCompiler
from mlxd.errors import MlxdError


class ConstraintError(MlxdError):
    """A row left its grammar: a sampled token the grammar does not allow, or llguidance failed (a parser limit).
    The engine fails that row alone."""

    type = "constraint_error"


@dataclass(frozen=True, slots=True, eq=False)
class MaskLayout:
    """What every row of one model and EOS set shares: bitmask words of ``num_words`` uint32, ``keep`` (the ids the
    grammar may allow: in the tokenizer, not EOS) and ``eos_bits``; logits are ``width`` wide."""

    width: int
    num_words: int
    keep: np.ndarray
    eos_bits: np.ndarray
    eos_ids: frozenset[int]
    tokenizer: LLTokenizer


def make_mask_layout(compiler: GrammarCompiler, eos_ids: Iterable[int]) -> MaskLayout:
    """The :class:`MaskLayout` for ``compiler``'s model with end-of-sequence ids ``eos_ids`` (at least one, each
    below the logits width ``compiler.n_vocab``)."""
    eos = frozenset(int(i) for i in eos_ids)
    width = compiler.n_vocab
    if not eos or not all(0 <= i < width for i in eos):
        raise ValueError(f"eos_ids must be one or more ids in [0, {width}), got {sorted(eos)}")
    tokenizer = compiler.llg_tokenizer()
    num_words = (tokenizer.vocab_size + 31) // 32
    real = np.zeros(num_words * 32, dtype=bool)
    real[: min(compiler.vocab_size, width)] = True
    eos_mask = np.zeros(num_words * 32, dtype=bool)
    eos_mask[sorted(eos)] = True
    return MaskLayout(
        width=width,
        num_words=num_words,
        keep=_pack(real & ~eos_mask),
        eos_bits=_pack(eos_mask),
        eos_ids=eos,
        tokenizer=tokenizer,
    )


class GrammarProcessor:
    """One row's grammar state, as an mlx-lm logits processor.

    ``tokens`` is the row's whole history (prompt, then each sampled token); the first call only notes its length
    (the prompt is not the grammar's), later calls consume what was appended since. ``logits`` is ``(1, width)``
    or ``(width,)``; the result has the same shape and dtype, with disallowed ids at ``-inf``. Tokens after an EOS
    are ignored (a pipelined engine may run one more step). ``ConstraintError`` when a token breaks the grammar.
    """

    __slots__ = ("_matcher", "_layout", "_bitmask", "_words", "_bytes", "_seen", "_start", "_done", "_done_at")

    def __init__(self, compiled: CompiledGrammar, layout: MaskLayout) -> None:
        self._matcher: LLMatcher = compiled.matcher.deep_copy()
        self._layout = layout
        self._bitmask = allocate_token_bitmask(1, layout.num_words * 32)
        self._words = self._bitmask.view(np.uint32)[0]
        self._bytes = self._bitmask.view(np.uint8)[0]
        self._seen: int | None = None
        self._start = 0  # the history's length at the first call: the prompt
        self._done = False
        self._done_at = 0  # the end of sequence's place in the history, once done

    @property
    def done(self) -> bool:
        """Whether the row has produced its end of sequence."""
        return self._done

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        seen, count = self._seen, tokens.size
        if logits.shape[-1] != self._layout.width:
            raise ConstraintError(f"logits are {logits.shape[-1]} wide; the grammar was set up for "
                                  f"{self._layout.width} (GrammarCompiler n_vocab)")
        if seen is not None and count < seen:
            raise ConstraintError(f"the token history shrank from {seen} to {count} tokens")
        self._seen = count
        if seen is None:
            self._start = count
        elif count > seen and not self._done:
            self._consume(tokens[seen:].tolist(), seen)
        self._fill_mask()
        allowed = np.unpackbits(self._bytes, count=self._layout.width, bitorder="little").view(np.bool_)
        return mx.where(mx.array(allowed), logits, -mx.inf)

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many of ``tokens``, the row's next ones (the first is the sampled token not fed to this processor
        yet), the grammar allows in a row; an end of sequence ends the count (speculative drafts stop before it)."""
        if self._done:
            return 0
        eos = next((i for i, token in enumerate(tokens) if token in self._layout.eos_ids), len(tokens))
        return self._matcher.validate_tokens(tokens[:eos]) if eos else 0

    def rollback(self, length: int) -> None:
        """The row's history was cut back to ``length`` tokens (speculative drafts the model did not keep): the
        grammar forgets the tokens it consumed past that."""
        if self._seen is None or length >= self._seen:
            return
        consumed_end = self._done_at if self._done else self._seen
        if consumed_end > max(length, self._start):
            self._matcher.rollback(consumed_end - max(length, self._start))
        if self._done and length <= self._done_at:
            self._done = False
        self._seen = length

    def _consume(self, new: list[int], at: int) -> None:
        """Feed the matcher ``new``, which starts at history position ``at``."""
        matcher = self._matcher
        for i, token in enumerate(new):
            if token in self._layout.eos_ids:
                if not matcher.is_accepting():
                    raise ConstraintError(f"end of sequence (token {token}) before the grammar is complete")
                self._done, self._done_at = True, at + i
                return
            if not matcher.consume_token(token):
                raise ConstraintError(f"token {token} ({self._layout.tokenizer.dbg_tokens([token])}) breaks the "
                                      f"grammar: {matcher.get_error()}")

    def _fill_mask(self) -> None:
        """The allowed ids into the bitmask: the grammar's (EOS exactly when it accepts), or EOS alone once done."""
        matcher, layout = self._matcher, self._layout
        if self._done or matcher.is_stopped():
            self._check(matcher)
            np.copyto(self._words, layout.eos_bits)
            return
        fill_next_token_bitmask(matcher, self._bitmask)
        self._check(matcher)
        np.bitwise_and(self._words, layout.keep, out=self._words)
        if matcher.is_accepting():
            np.bitwise_or(self._words, layout.eos_bits, out=self._words)

    @staticmethod
    def _check(matcher: LLMatcher) -> None:
        if matcher.is_error():
            raise ConstraintError(f"grammar matcher failed: {matcher.get_error()}")


def make_grammar_processor(compiled: CompiledGrammar, compiler: GrammarCompiler,
                           eos_ids: Iterable[int]) -> GrammarProcessor:
    """A fresh processor for one row: ``compiled`` (from ``compiler``) with end of sequence at ``eos_ids``."""
    return GrammarProcessor(compiled, make_mask_layout(compiler, eos_ids))


def make_constraint_factory(compiled: CompiledGrammar, compiler: GrammarCompiler,
                            eos_ids: Iterable[int]) -> Callable[[], list[GrammarProcessor]]:
    """A zero-argument factory the engine calls once per row (each of ``n`` siblings gets its own): it returns a
    new list holding a fresh :class:`GrammarProcessor`. The mask layout is built once, here."""
    layout = make_mask_layout(compiler, eos_ids)
    return lambda: [GrammarProcessor(compiled, layout)]


def _pack(bits: np.ndarray) -> np.ndarray:
    """Booleans to uint32 words, id ``i`` at bit ``i % 32`` of word ``i // 32`` (llguidance's bitmask layout)."""
    return np.packbits(bits, bitorder="little").view(np.uint32)
