"""Parsers of generated text: tool calls and reasoning, by model family, looked up by name in registries."""
