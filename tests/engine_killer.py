"""Serve a config as ``mlxd --config`` does, with a model double that ends the engine thread on demand.

``python -m tests.engine_killer CONFIG``: a prompt of exactly ``KILL_LENGTH`` tokens makes the model raise an
exception that no request handler may catch (a ``BaseException``), as a bug outside the engine's guards would.
The process must then report the failure and exit non-zero.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

KILL_LENGTH = 37


class EngineKilled(BaseException):
    """Escapes every ``except Exception``: the engine thread ends."""


class KillingModel:
    """Delegates to the real model; raises :class:`EngineKilled` for an input of ``KILL_LENGTH`` tokens."""

    def __init__(self, model: Any) -> None:
        self._model = model

    def __call__(self, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        if inputs.shape[-1] == KILL_LENGTH:
            raise EngineKilled("injected fault: the engine thread ends here")
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
                    make_engine=lambda engine_config, model, drafter: make_engine(engine_config, KillingModel(model),
                                                                              drafter))
    return run_server(create_app(daemon), daemon)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
