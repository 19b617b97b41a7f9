"""The core's limits, resolved once at warm-up and logged: the memory budget that admission counts against
(``memory_budget``), and ``max_running``, as set or derived from that budget (``max_running``, with where it came
from). The measurements themselves are :mod:`mlxd.engine.schedule.memory`'s."""

from __future__ import annotations

import mlx.core as mx
import msgspec

from mlxd.config.schema import EngineConfig
from mlxd.engine.schedule.memory import (
    MAX_DERIVED_RUNNING,
    MAX_DERIVED_RUNNING_GPU,
    MemoryBudget,
    RunningLimit,
    derive_max_running,
)
from mlxd.log import get_logger

log = get_logger("mlxd.engine")


def log_memory_budget(memory: MemoryBudget, max_pass_tokens: int) -> None:
    """One ``memory_budget`` line: the limit, the weights, a request's cache per token, a prompt pass's cost."""
    log.info("memory_budget", limit_bytes=memory.limit_bytes, weights_bytes=memory.weights_bytes,
             kv_bytes_per_token=memory.kv.num_bytes_per_token_total,
             kv_fixed_bytes=memory.kv.num_fixed_bytes, cache_limit_bytes=memory.cache_limit_bytes,
             pass_bytes_per_token=memory.pass_bytes_per_token, max_pass_tokens=max_pass_tokens)


def resolve_max_running(config: EngineConfig, memory: MemoryBudget) -> tuple[RunningLimit, EngineConfig]:
    """``[engine] max_running`` as set, or (0) derived from the memory budget; logged with where it came from.
    Returns the limit and ``config`` holding the number (the same ``config`` when it was set)."""
    if config.max_running:
        limit = RunningLimit(config.max_running, "config")
    else:
        limit = derive_max_running(memory, prefix_cache_bytes=config.prefix_cache_bytes,
                                   max_kv_size=config.max_kv_size, cap=derived_cap())
        config = msgspec.structs.replace(config, max_running=limit.max_running)
    log.info("max_running", max_running=limit.max_running, source=limit.source,
             **({"context_tokens": limit.context_tokens, "row_bytes": limit.row_bytes,
                 "room_bytes": limit.room_bytes, "prefix_cache_bytes": config.prefix_cache_bytes,
                 "max_derived": derived_cap()} if limit.source == "derived" else {}))
    return limit, config


def derived_cap() -> int:
    """The most rows a derived ``max_running`` allows: fewer on the CPU than on a GPU."""
    return MAX_DERIVED_RUNNING if mx.default_device() == mx.cpu else MAX_DERIVED_RUNNING_GPU
