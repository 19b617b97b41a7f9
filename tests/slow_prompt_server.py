"""Serve a config as ``mlxd --config`` does, with a model double whose prompt passes are slow.

``python -m tests.slow_prompt_server CONFIG``: every forward pass of more than one token (a prompt chunk) sleeps
``PROMPT_PASS_S`` first, so that a test can watch a long prompt go in chunk by chunk and leave in the middle.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

PROMPT_PASS_S = 0.25


class SlowPromptModel:
    """Delegates to the real model; a pass over more than one token sleeps first."""

    def __init__(self, model: Any) -> None:
        self._model = model

    def __call__(self, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        if inputs.shape[-1] > 1:
            time.sleep(PROMPT_PASS_S)
        return self._model(inputs, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)


def main(config_path: str) -> int:
    from mlxd.api.app import create_app
    from mlxd.cli import load_everything
    from mlxd.daemon import Daemon
    from mlxd.engine.factory import make_engine
    from mlxd.log import configure_logging
    from mlxd.server import run_server

    path = Path(config_path)
    config, pipeline = load_everything(path)
    configure_logging(config.logging.level, config.logging.format)
    daemon = Daemon(config, pipeline, base_dir=path.parent,
                    make_engine=lambda engine_config, model, drafter: make_engine(engine_config,
                                                                              SlowPromptModel(model), drafter))
    return run_server(create_app(daemon), daemon)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
