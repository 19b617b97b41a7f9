"""Serve a config as ``mlxd --config`` does, with a model double that generates a scripted text exactly.

``python -m tests.scripted_server CONFIG SCRIPT``: ``SCRIPT`` is a file holding the text to generate (re-read at
every new prompt, so a test can change it between requests). The double runs the real model (caches, shapes and
the batch step stay real) and replaces its logits: at generated position ``i`` only the ``i``-th token of the
script's tokenization is possible, then end-of-sequence. It serves one request at a time (it keeps one position)
and needs the prefix cache off (a cache hit runs a prompt of one token).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import mlx.core as mx


class ScriptedModel:
    def __init__(self, model: Any, tokenizer: Any, script: Path) -> None:
        self._model, self._tokenizer, self._script = model, tokenizer, script
        self._prompt_end = 0
        self._tokens: list[int] = []

    def __call__(self, inputs: mx.array, cache: Any = None, **kwargs: Any) -> mx.array:
        logits = self._model(inputs, cache=cache, **kwargs)
        offset = cache[0].offset
        offset = int(offset.max().item()) if isinstance(offset, mx.array) else int(offset)
        if inputs.shape[1] > 1:  # a prompt: the script starts after it
            self._prompt_end = offset
            self._tokens = self._tokenizer.encode(self._script.read_text(), add_special_tokens=False)
        position = offset - self._prompt_end
        eos = self._tokenizer.eos_token_ids
        token = self._tokens[position] if 0 <= position < len(self._tokens) else next(iter(eos))
        forced = mx.where(mx.arange(logits.shape[-1]) == token, 100.0, -100.0).astype(logits.dtype)
        return mx.broadcast_to(forced, logits.shape)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)


def main(config_path: str, script: str) -> int:
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    from mlxd.api.app import create_app
    from mlxd.cli import load_everything
    from mlxd.daemon import Daemon
    from mlxd.engine.factory import make_engine
    from mlxd.log import configure_logging
    from mlxd.server import run_server

    path = Path(config_path)
    config, pipeline = load_everything(path)
    configure_logging(config.logging.level, config.logging.format)
    tokenizer = load_tokenizer(Path(config.model.source))

    def scripted_engine(engine_config: Any, model: Any, drafter: Any) -> Any:
        return make_engine(engine_config, ScriptedModel(model, tokenizer, Path(script)), drafter)

    daemon = Daemon(config, pipeline, base_dir=path.parent, make_engine=scripted_engine)
    return run_server(create_app(daemon), daemon)


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
