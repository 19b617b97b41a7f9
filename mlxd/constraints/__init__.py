"""Grammar-constrained decoding with llguidance: structured output (``response_format``) and forced tool calls.

A pipeline stage compiles the request's feature once (:class:`GrammarCompiler`, one per served model) and hands the
engine a factory (:func:`make_constraint_factory`) that makes each row its own logits processor.
"""

from mlxd.constraints.grammar import CompiledGrammar, GrammarCompiler
from mlxd.constraints.processor import (
    ConstraintError,
    GrammarProcessor,
    MaskLayout,
    make_constraint_factory,
    make_grammar_processor,
    make_mask_layout,
)

__all__ = [
    "CompiledGrammar",
    "ConstraintError",
    "GrammarCompiler",
    "GrammarProcessor",
    "MaskLayout",
    "make_constraint_factory",
    "make_grammar_processor",
    "make_mask_layout",
]
