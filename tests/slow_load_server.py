"""Serve a config as ``mlxd --config`` does, with models whose load is slow.

``python -m tests.slow_load_server CONFIG``: the models loaded after the first one (those loaded on request) take
``LOAD_S`` seconds longer to load, through the daemon's own engine factory (``Daemon(make_engine=...)``:
:func:`slow_engines`), so that a test can watch requests wait for a load.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mlxd.errors import ModelLoadError

LOAD_S = 4.0


def slow_engines(load_s: float = LOAD_S, fail: bool = False) -> Callable[[Any, Any, Any], Any]:
    """An engine factory for ``Daemon(make_engine=...)``: the first engine is built at once (the model loaded at
    start), each later one after ``load_s`` seconds, or (``fail``) not at all: its load fails then."""
    from mlxd.engine.factory import make_engine

    built: list[int] = []
    lock = threading.Lock()

    def build(engine_config: Any, model: Any, drafter: Any) -> Any:
        with lock:
            first = not built
            built.append(1)
        if not first:
            time.sleep(load_s)
            if fail:
                raise ModelLoadError(f"this test's model failed to load after {load_s} s")
        return make_engine(engine_config, model, drafter)

    return build


def main(config_path: str) -> int:
    from mlxd.api.app import create_app
    from mlxd.cli import load_everything
    from mlxd.daemon import Daemon
    from mlxd.log import configure_logging
    from mlxd.server import run_server

    path = Path(config_path)
    config, pipeline = load_everything(path)
    configure_logging(config.logging.level, config.logging.format)
    daemon = Daemon(config, pipeline, base_dir=path.parent, make_engine=slow_engines())
    return run_server(create_app(daemon), daemon)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
