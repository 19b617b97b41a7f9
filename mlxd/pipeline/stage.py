"""The stage contract.

A stage has a light ``__init__(config)`` (its own validated ``Config`` struct), a heavy ``warm_up(ctx)``
that takes what it needs from the loaded model, and two hooks that a request passes through in pipeline
order: ``prepare(job)`` shapes the request (messages → prompt → engine request), ``stream(job, events)``
transforms the response stream (engine tokens → text). Either hook may be left as the default pass-through.

Each stage declares the :class:`~mlxd.pipeline.job.Job` fields it ``needs`` (cannot work without) and those its
``prepare`` ``provides``. Every ``prepare`` runs before any ``stream``, in pipeline order, so a field a stage needs
must be a request field (:data:`~mlxd.pipeline.job.REQUEST_FIELDS`, filled in by the API) or provided by an earlier
stage: :func:`mlxd.pipeline.pipeline.build_pipeline` checks that at start-up and in ``mlxd check-config``, before a
model is loaded, and names the pipeline file, the stage and the field when it does not hold.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import msgspec

from mlxd.config.schema import DaemonConfig
from mlxd.engine.base import Engine
from mlxd.pipeline.job import Job


class NoOptions(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    """The options struct of a stage that takes none."""


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """What stages may know of the served model, without touching MLX."""

    name: str
    context_length: int
    eos_token_ids: frozenset[int]
    special_token_ids: frozenset[int]
    kind: str = "text"
    # Token ids valid in requests (logit_bias keys, prompt ids): 0 <= id < vocab_size.
    vocab_size: int = 0
    # Vision models: the placeholder token the processor repeats for each image's features.
    image_token_id: int | None = None


@dataclass(slots=True)
class PipelineContext:
    """Handed to every stage's ``warm_up``."""

    config: DaemonConfig
    model: ModelInfo
    tokenizer: Any  # mlx_lm TokenizerWrapper (a Hugging Face tokenizer with a streaming detokenizer)
    engine: Engine
    # Vision models: mlx-vlm's processor (images → pixel inputs, placeholders expanded); None for text models.
    processor: Any = None
    # The config file's folder: relative paths in the config ([vision] local_dir) start there.
    base_dir: Path | None = None


class Stage:
    """Base class of built-in stages; third-party stages may subclass it or just follow the contract."""

    name: ClassVar[str] = ""
    Config: ClassVar[type[msgspec.Struct]] = NoOptions
    # Options that moved elsewhere (option → its new place, e.g. "[engine] prefill_chunk"): setting one is a
    # config error that names the new place, rather than "unknown field".
    moved_options: ClassVar[dict[str, str]] = {}
    # Job fields the stage reads and cannot do without, and those its ``prepare`` fills in (see the module's text).
    needs: ClassVar[frozenset[str]] = frozenset()
    provides: ClassVar[frozenset[str]] = frozenset()

    def __init__(self, config: msgspec.Struct) -> None:
        self.config = config

    def warm_up(self, ctx: PipelineContext) -> None:
        """Load what the stage needs; called once, before the server reports ready."""

    def prepare(self, job: Job) -> None:
        """Shape the request in place. Raise ``RequestError`` for requests the stage cannot honour.

        Runs on a worker thread, not the event loop (it may render and tokenize large prompts): it must not
        touch asyncio objects, and several requests may be prepared at once."""

    def stream(self, job: Job, events: AsyncIterator[Any]) -> AsyncIterator[Any]:
        """Transform the response stream; the default passes it through unchanged."""
        return events
