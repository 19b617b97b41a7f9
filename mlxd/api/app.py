"""``create_app(daemon)``: the Litestar application. This layer never imports MLX."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from litestar import Litestar
from litestar.config.cors import CORSConfig
from litestar.di import Provide

from mlxd import __version__
from mlxd.api.anthropic import AnthropicController
from mlxd.api.auth import load_keys, make_guard
from mlxd.api.docs import make_docs_config
from mlxd.api.embeddings import EmbeddingsController
from mlxd.api.errors import EXCEPTION_HANDLERS
from mlxd.api.metrics import Metrics
from mlxd.api.openai import OpenAIController
from mlxd.api.ops import OpsController, PromptViewers
from mlxd.api.origins import make_origin_guard
from mlxd.api.responses import ResponsesController
from mlxd.daemon import Daemon
from mlxd.log import get_logger

log = get_logger("mlxd.api")


def create_app(daemon: Daemon, *, load: bool = True) -> Litestar:
    """Build the app. With ``load``, the model loads on a background thread when the app starts.

    API keys are read here, once: a keys file that is missing or holds no key is a ``ConfigError`` naming it."""
    server = daemon.config.server
    keys = load_keys(server, daemon.base_dir)
    if keys.enabled:  # how many, never which
        log.info("api_keys", num_keys=len(keys.api), num_admin_keys=len(keys.admin),
                 metrics_need_key=keys.metrics_need_key)
    metrics = Metrics(daemon)
    viewers = PromptViewers(keys.admin if server.status_shows_prompts else ())
    if server.status_shows_prompts and not keys.admin:
        log.warning("status_shows_prompts_without_admin_keys",
                    detail="[server] status_shows_prompts needs admin_keys_file or MLXD_ADMIN_KEYS; no one sees prompts")

    @asynccontextmanager
    async def lifespan(_: Litestar) -> AsyncIterator[None]:
        if load:
            daemon.start_loading()
        try:
            yield
        finally:
            daemon.close()

    return Litestar(
        route_handlers=[
            OpenAIController,
            EmbeddingsController,
            AnthropicController,
            ResponsesController,
            OpsController,
        ],
        dependencies={"daemon": Provide(lambda: daemon, use_cache=True, sync_to_thread=False),
                      "metrics": Provide(lambda: metrics, use_cache=True, sync_to_thread=False),
                      "viewers": Provide(lambda: viewers, use_cache=True, sync_to_thread=False)},
        # Origins first: a request from another web origin is refused before any key or body is looked at.
        guards=[make_origin_guard(server), make_guard(keys)],
        exception_handlers=EXCEPTION_HANDLERS,
        lifespan=[lifespan],
        request_max_body_size=server.max_body_bytes,
        cors_config=CORSConfig(allow_origins=server.cors_origins) if server.cors_origins else None,
        openapi_config=make_docs_config("mlxd", __version__),
        debug=False,
    )
