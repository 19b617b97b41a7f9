"""One served model's slot in the registry (:mod:`mlxd.registry`): load it (model → engine → what the pipeline knows
of it → the warmed pipeline), serve its requests' preparation, and let it go again. MLX is imported only inside
the loading steps."""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec

from mlxd.config.models import ServedModel
from mlxd.errors import MlxdError, Overloaded, RequestError
from mlxd.log import get_logger
from mlxd.models.generation_config import with_model_sampling
from mlxd.pipeline.job import Job
from mlxd.pipeline.stage import ModelInfo, PipelineContext
from mlxd.runtime.cancel import CancelFlag

log = get_logger("mlxd.models")

LEASE_S = 1.0  # a request that got its model reaches preparation within a turn of the event loop


@dataclass
class SlotHooks:
    """What every slot shares with the daemon: where the config lives, the distributed group, the engine factory
    (``make_engine(engine_config, model, drafter)``; tests pass doubles), the device turn (several models), the
    preparation workers, a pipeline factory for a model's config, and who hears of a dead engine."""

    base_dir: Any
    group: Any
    make_engine: Callable[[Any, Any, Any], Any] | None
    turn: Any
    preparation: Any
    max_preparing: int
    make_pipeline: Callable[[Any], Any]
    on_engine_failure: Callable[[ModelSlot, str], None]


def special_token_ids(tokenizer: Any) -> frozenset[int]:
    """Tokens that never belong in content: the tokenizer's special tokens and added tokens marked special
    (chat markers such as ``<|im_start|>``), but not added tokens like ``<tool_call>`` that parsers need."""
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    marked = {token_id for token_id, token in added.items() if getattr(token, "special", False)}
    return frozenset(tokenizer.all_special_ids) | marked


def prompt_bytes_bound(context_length: int, tokenizer: Any) -> int:
    """Bytes of rendered text that cannot fit in ``context_length`` tokens: no token stands for more text than its
    vocabulary entry's UTF-8 bytes, and a normalizer such as NFKC folds at most 4 bytes of input into 1 (the
    template stage refuses on the same bound, after rendering)."""
    from mlxd.pipeline.stages.template import max_token_bytes

    return context_length * max_token_bytes(tokenizer) * 4


class ModelSlot:
    """One configured model: ``state`` (``unloaded``, ``loading``, ``ready``, ``failed``), and while loaded its
    ``engine``, warmed ``pipeline`` and ``model_info``; its memory (``weight_bytes``, and ``active_bytes``: MLX
    active memory its load added) and its requests (``num_requests``, ``last_used``)."""

    def __init__(self, served: ServedModel, hooks: SlotHooks, pipeline: Any = None) -> None:
        self.served, self.hooks = served, hooks
        self.name, self.config = served.name, served.config
        self.state, self.error = "unloaded", None
        self.engine: Any = None
        self.pipeline = pipeline  # assembled, not warmed; built again for each load after an unload
        self.model_info: ModelInfo | None = None
        self.max_prompt_bytes = 0  # bytes of rendered text that prove a prompt cannot fit (mlxd.api.validate)
        self.load_s: float | None = None
        self.weight_bytes = 0
        self.active_bytes = 0
        self.summary: dict[str, Any] = {}
        self.last_used = time.monotonic()
        self.num_requests = self.num_loads = self.num_unloads = 0
        self.num_preparing = self._num_leased = 0
        self._leased_at = 0.0
        self.loading: asyncio.Future | None = None  # the load running on a thread
        self.admitting: asyncio.Future | None = None  # room being made for a load (mlxd.registry)
        # Its side of the budget several models' engines share (mlxd.registry.KVLedger); None: no shared budget.
        self.kv_share: Any = None

    # ---- loading (a loader thread) ----

    def load(self) -> None:
        """Load the model, start and warm its engine, warm its pipeline (blocking); then ``ready``."""
        import mlx.core as mx

        started, before = time.monotonic(), mx.get_active_memory()
        loaded = self._load_model()
        self._start_engine(loaded)
        self.model_info = self._model_info(loaded)
        self.max_prompt_bytes = prompt_bytes_bound(loaded.context_length, loaded.tokenizer)
        if self.pipeline is None:
            self.pipeline = self.hooks.make_pipeline(self.config)
        self._warm_up_pipeline(loaded)
        self.active_bytes = max(0, mx.get_active_memory() - before)
        self.load_s = time.monotonic() - started
        self.summary = {"path": str(loaded.path), "dtype": loaded.dtype, "context_length": loaded.context_length}
        self.state, self.error = "ready", None
        self.num_loads += 1
        self.touch()
        log.info("model_loaded", model=self.name, load_s=round(self.load_s, 2), weight_bytes=self.weight_bytes,
                 active_bytes=self.active_bytes, **self.summary)

    def load_safely(self) -> None:
        """:meth:`load`, with a failure recorded in ``state`` and ``error`` (and logged) instead of raised."""
        try:
            self.load()
        except MlxdError as e:
            self.fail(e.message)
        except Exception as e:  # noqa: BLE001 - reported in state, the request's 503 and the log, never swallowed
            log.exception("model_load_failed", model=self.name)
            self.fail(f"{type(e).__name__}: {e}")

    def fail(self, message: str) -> None:
        self.state, self.error = "failed", message
        log.error("model_load_failed", model=self.name, error=message)
        engine, self.engine, self.pipeline = self.engine, None, None
        if engine is not None:
            engine.stop()

    def _load_model(self) -> Any:
        """The model, its tokenizer and processor, on the served device; the config then takes the model's own
        sampling defaults where ``[model.sampling]`` leaves them open."""
        from mlx.utils import tree_flatten

        from mlxd.models.encoder import encoder_type, load_encoder
        from mlxd.models.load import load

        model, base_dir = self.config.model, self.hooks.base_dir
        loaded = (load_encoder(model, base_dir) if encoder_type(model, base_dir)  # BERT-family embedding models
                  else load(model, base_dir, group=self.hooks.group))
        self.config = with_model_sampling(self.config, loaded.path)  # [model.sampling] > the model's > mlxd's
        self.weight_bytes = sum(v.nbytes for _, v in tree_flatten(loaded.model.parameters()))
        return loaded

    def _start_engine(self, loaded: Any) -> None:
        """Build the engine for the loaded model and start its thread (it warms up there)."""
        from mlxd.engine.engine import BatchedEngine

        self.engine = self._new_engine(loaded)
        self.engine.on_failure = lambda reason: self.hooks.on_engine_failure(self, reason)
        if isinstance(self.engine, BatchedEngine):  # a burst waits for the requests still being prepared
            self.engine.engine_loop.incoming = lambda: self.num_preparing
        self.engine.start()

    def _new_engine(self, loaded: Any) -> Any:
        """A distributed leader under ``[distributed]``; an embedding model's engine; else ``make_engine``'s (with
        the configured drafter), taking the device's turn when several models share it."""
        from mlxd.engine.drafters.registry import make_drafter

        config, hooks = self.config, self.hooks
        if config.model.kind == "embedding":
            from mlxd.engine.embedding import make_embedding_engine

            return make_embedding_engine(config.model, config.engine, loaded, self.name, turn=hooks.turn)
        engine = engine_within_budget(config)
        if hooks.group is not None:
            from mlxd.engine.distributed.channel import Channel
            from mlxd.engine.distributed.leader import make_leader_engine

            return make_leader_engine(loaded.model, engine, channel=Channel(hooks.group), settings=config.distributed)
        drafter = make_drafter(engine.speculative, loaded.model, loaded.path, hooks.base_dir)
        if hooks.make_engine is not None:
            return hooks.make_engine(engine, loaded.model, drafter)
        if hooks.turn is not None:  # several models on one device: each step takes the device's turn
            from mlxd.engine.engine import BatchedEngine

            return BatchedEngine(loaded.model, engine, drafter=drafter, held=functools.partial(hooks.turn.held, self.name),
                                 kv_share=self.kv_share)
        from mlxd.engine.factory import make_engine

        return make_engine(engine, loaded.model, drafter)

    def _model_info(self, loaded: Any) -> ModelInfo:
        """What the pipeline's stages know of the model."""
        tokenizer = loaded.tokenizer
        return ModelInfo(
            name=self.name,
            context_length=loaded.context_length,
            eos_token_ids=frozenset(tokenizer.eos_token_ids),
            special_token_ids=special_token_ids(tokenizer),
            kind=loaded.kind,
            vocab_size=self.engine.vocab_size,  # the logits width, measured at warm-up
            image_token_id=getattr(loaded.model, "image_token_id", None),
        )

    def _warm_up_pipeline(self, loaded: Any) -> None:
        """Warm the pipeline's stages; for a vision model, bound Pillow's decoder first and send the warm-up
        images through afterwards."""
        from mlxd.runtime.progress import phase

        if loaded.kind == "vision":
            from mlxd.media.images import bound_pillow

            bound_pillow(self.config.vision.max_decode_pixels)
        with phase("pipeline_warm_up", stages=[name for name, _ in self.pipeline.stages]):
            self.pipeline.warm_up(PipelineContext(self.config, self.model_info, loaded.tokenizer, self.engine,
                                                  processor=loaded.processor, base_dir=self.hooks.base_dir))
        if loaded.kind == "vision":
            self._warm_up_images()

    def _warm_up_images(self) -> None:
        """One image request and its second turn per ``[vision] warm_up_image_sizes`` through the pipeline
        (:mod:`mlxd.pipeline.image_warmup`); a model or a config that cannot take them is logged, not fatal: text
        is still served."""
        from mlxd.pipeline.image_warmup import warm_up_image

        for size in self.config.vision.warm_up_image_sizes:
            try:
                seconds, cached = warm_up_image(self.pipeline, self.name, size)
            except MlxdError as e:
                log.warning("image_warm_up_failed", size=size, error=e.message)
                return
            log.info("image_warm_up", size=size, seconds=round(seconds, 2), turn_2_cached_tokens=cached)

    # ---- unloading (the event loop, then a thread frees the engine) ----

    def detach(self) -> Any:
        """Turn ``unloaded`` and hand back the engine (to stop and free); the warmed pipeline, which holds it, and
        what was known of the model go."""
        engine, self.engine = self.engine, None
        self.pipeline, self.model_info, self.max_prompt_bytes = None, None, 0
        self.state = "unloaded"
        self.num_unloads += 1
        return engine

    # ---- requests (the event loop) ----

    def touch(self) -> None:
        self.last_used = time.monotonic()

    def lease(self) -> None:
        """A request got this model: it counts as busy until it reaches preparation (at most ``LEASE_S``)."""
        self.num_requests += 1
        self._num_leased += 1
        self._leased_at = time.monotonic()
        self.touch()

    def busy(self) -> bool:
        """Requests in its engine, in preparation, or on their way there."""
        leased = self._num_leased > 0 and time.monotonic() - self._leased_at < LEASE_S
        return leased or self.num_preparing > 0 or (self.engine is not None and self.engine.num_active > 0)

    @property
    def holds_memory(self) -> bool:
        return self.state in ("ready", "loading")

    def expected_bytes(self) -> int:
        """Bytes its weights hold: measured once loaded, before that the size of its weight files."""
        if self.weight_bytes:
            return self.weight_bytes
        return weight_file_bytes(self.config.model.source, self.hooks.base_dir)

    def memory(self) -> dict[str, int]:
        """What it holds against the models' memory budget: ``weights`` (:meth:`expected_bytes`), and while its
        engine runs, ``kv`` (its running requests' cache reservations) and ``prefix_cache`` (its snapshots), as the
        engine reports them (``memory_bytes()``)."""
        engine = self.engine
        held = engine.memory_bytes() if engine is not None else {"kv": 0, "prefix_cache": 0}
        return {"weights": self.expected_bytes(), "kv": held["kv"], "prefix_cache": held["prefix_cache"]}

    def held_bytes(self) -> int:
        """Bytes counted against the budget while it holds memory (loading or ready): weights, KV, prefix cache."""
        return sum(self.memory().values()) if self.holds_memory else 0

    async def prepare(self, job: Job, flag: CancelFlag, until: str | None = None) -> Job:
        """Run the pipeline's ``prepare`` (up to the stage named ``until``) on a preparation worker.

        Requests waiting for or in preparation count against the queue: beyond ``[server] max_preparing``, or
        when they and the engine's requests fill ``[engine] max_running + max_waiting``, a newcomer gets
        ``Overloaded`` (429 with ``Retry-After``) before any work. ``flag`` stops the work at its next check."""
        if self.config.model.kind == "embedding":  # before its template stage, which a BERT model cannot run
            raise RequestError(f"model {self.name!r} is an embedding model: it serves POST /v1/embeddings only",
                               param="model")
        engine, preparation = self.engine, self.hooks.preparation
        num_preparing = preparation.num_preparing
        num_engine = engine.num_active if engine is not None else 0
        # max_running as the engine resolved it (0 in the config: derived from the memory budget at warm-up).
        max_running = engine.max_running if engine is not None else self.config.engine.max_running
        capacity = max(max_running, 1) + self.config.engine.max_waiting
        max_preparing = self.hooks.max_preparing or capacity
        if num_preparing >= max_preparing or num_preparing + num_engine >= capacity:
            retry_after = max(engine.retry_after_s() if engine is not None else 1.0, preparation.estimate_s())
            raise Overloaded(f"{num_preparing} requests are being prepared (at most {max_preparing}) and "
                             f"{num_engine} are in the engine (at most {capacity} in all); retry shortly",
                             retry_after=retry_after)
        args = (job,) if until is None else (job, until)  # a plain prepare(job) for whoever wraps the pipeline
        self._num_leased = max(0, self._num_leased - 1)
        self.num_preparing += 1
        try:
            return await preparation.submit(self.pipeline.prepare, *args, flag=flag)
        finally:
            self.num_preparing -= 1
            self.touch()

    def size_limits(self) -> dict[str, int]:
        """The bounds ``mlxd.api.validate.check_size`` checks a body against (no text bound before loading)."""
        return {"max_prompt_bytes": self.max_prompt_bytes, "max_messages": self.config.server.max_messages,
                "context_length": self.model_info.context_length if self.model_info is not None else 0}

    def describe(self) -> dict[str, Any]:
        """State, memory and requests, for status pages and metrics."""
        engine = self.engine
        memory = self.memory() if engine is not None else {"kv": 0, "prefix_cache": 0}
        return {"name": self.name, "state": self.state, **({"error": self.error} if self.error else {}),
                "load": self.served.load, "pin": self.served.pin, "idle_unload_s": self.served.idle_unload_s,
                "weight_bytes": self.weight_bytes, "active_bytes": self.active_bytes if engine is not None else 0,
                "kv_bytes": memory["kv"], "prefix_cache_bytes": memory["prefix_cache"],
                "memory_bytes": self.held_bytes(),
                "num_requests": self.num_requests, "num_active": engine.num_active if engine is not None else 0,
                "num_loads": self.num_loads, "num_unloads": self.num_unloads,
                "idle_s": round(time.monotonic() - self.last_used, 1)}


def engine_within_budget(config: Any) -> Any:
    """The model's ``[engine]`` settings with ``memory_limit_bytes`` (what its admission lets weights, KV and prefix
    cache hold; 0: a share of the device's memory) at most ``[server] models_memory_bytes``: one model alone never
    holds more than all of them may together (the registry keeps their sum within it). Called where MLX may load."""
    engine, budget = config.engine, config.server.models_memory_bytes
    if not budget:
        return engine
    from mlxd.engine.schedule.memory import default_limit_bytes

    return msgspec.structs.replace(engine, memory_limit_bytes=min(engine.memory_limit_bytes or default_limit_bytes(),
                                                                  budget))


def weight_file_bytes(source: str, base_dir: Any) -> int:
    """Bytes of a model source's weight files (a folder's ``*.safetensors``, or a file such as a ``.gguf``); 0 where
    that is not known before loading (an embedded model, a source that does not exist)."""
    from pathlib import Path

    path = Path(source).expanduser()
    if not path.is_absolute() and base_dir is not None:
        path = Path(base_dir) / path
    if path.is_dir():
        return sum(f.stat().st_size for f in path.glob("*.safetensors"))
    return path.stat().st_size if path.is_file() else 0
