"""The composition root: config → model → engine → pipeline.

``Daemon`` is what the HTTP layer talks to. It imports MLX only inside :meth:`load`, which runs on a
background thread while the server already answers ``/health`` with 503.
"""

from __future__ import annotations

import fnmatch
import threading
import time
from pathlib import Path
from typing import Any

from mlxd.config.schema import DaemonConfig
from mlxd.errors import MlxdError, ModelNotFound, NotReady
from mlxd.log import get_logger
from mlxd.pipeline.pipeline import Pipeline
from mlxd.pipeline.stage import ModelInfo, PipelineContext

log = get_logger("mlxd.daemon")


def special_token_ids(tokenizer: Any) -> frozenset[int]:
    """Tokens that never belong in content: the tokenizer's special tokens and added tokens marked special
    (chat markers such as ``<|im_start|>``), but not added tokens like ``<tool_call>`` that parsers need."""
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    marked = {token_id for token_id, token in added.items() if getattr(token, "special", False)}
    return frozenset(tokenizer.all_special_ids) | marked


class Daemon:
    """Owns the loaded model, the engine and the assembled pipeline."""

    def __init__(self, config: DaemonConfig, pipeline: Pipeline, base_dir: Path | None = None) -> None:
        self.config = config
        self.pipeline = pipeline
        self.base_dir = base_dir
        self.state = "loading"
        self.error: str | None = None
        self.engine: Any = None
        self.model_info: ModelInfo | None = None
        self.created = int(time.time())
        self.name = config.model.name or Path(config.model.source).stem or "model"
        self._loader: threading.Thread | None = None

    @property
    def ready(self) -> bool:
        return self.state == "ready"

    def start_loading(self) -> None:
        """Load on a background thread; ``state`` becomes ``ready`` or ``failed``."""
        self._loader = threading.Thread(target=self._load_safely, name="mlxd-loader", daemon=True)
        self._loader.start()

    def wait_loaded(self, timeout: float | None = None) -> None:
        if self._loader is not None:
            self._loader.join(timeout)

    def _load_safely(self) -> None:
        try:
            self.load()
        except MlxdError as e:
            self._fail(e.message)
        except Exception as e:  # noqa: BLE001 - reported in state/health and the log, never swallowed
            log.exception("load_failed")
            self._fail(f"{type(e).__name__}: {e}")

    def _fail(self, message: str) -> None:
        self.state, self.error = "failed", message
        log.error("model_load_failed", error=message)

    def load(self) -> None:
        """Load the model, start and warm the engine, warm the pipeline's stages (blocking)."""
        from mlxd.engine.factory import make_engine
        from mlxd.models.load import load, platform_summary
        from mlxd.runtime.blas import mapped_blas

        started = time.monotonic()
        loaded = load(self.config.model, self.base_dir)
        tokenizer = loaded.tokenizer
        self.model_info = ModelInfo(
            name=self.name,
            context_length=loaded.context_length,
            eos_token_ids=frozenset(tokenizer.eos_token_ids),
            special_token_ids=special_token_ids(tokenizer),
            kind=loaded.kind,
        )
        self.engine = make_engine(self.config.engine, loaded.model)
        self.engine.start()
        self.pipeline.warm_up(PipelineContext(self.config, self.model_info, tokenizer, self.engine))
        self.state = "ready"
        log.info(
            "model_ready",
            model=self.name,
            path=str(loaded.path),
            dtype=loaded.dtype,
            context_length=loaded.context_length,
            blas=mapped_blas(),
            load_s=round(time.monotonic() - started, 2),
            **platform_summary(),
        )

    def close(self) -> None:
        if self.engine is not None:
            self.engine.stop()

    def require_ready(self) -> None:
        if self.state == "failed":
            raise NotReady(f"the model failed to load: {self.error}")
        if not self.ready:
            raise NotReady("the model is still loading; retry when GET /health returns 200")

    def served_names(self) -> list[str]:
        return [self.name]

    def resolve_model(self, requested: str) -> str:
        """Map a request's ``model`` to the served name (exact name or an alias glob), else 404."""
        if requested == self.name or any(fnmatch.fnmatchcase(requested, p) for p in self.config.model.aliases):
            return self.name
        aliases = f" or a name matching {self.config.model.aliases}" if self.config.model.aliases else ""
        raise ModelNotFound(f"model {requested!r} is not served here; use {self.name!r}{aliases}", param="model")
