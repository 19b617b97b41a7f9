"""Drafters: what proposes tokens for a speculative row to verify (:mod:`mlxd.engine.drafters.base`)."""
