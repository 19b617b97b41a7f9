"""Test helpers that need no network: tiny random-weight MLX models and a locally trained tokenizer.

Used by the test suite and by benchmark scripts; nothing in the serving path imports this package.
"""
