"""What ``GET /v1/status`` shows of a batching engine (:class:`mlxd.engine.engine.BatchedEngine`): its requests,
limits, totals, step times, memory, and its speculative, distributed and disk-tier parts where it has them.
Read from the event loop: the request table's lock guards the queues while they are copied."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import mlx.core as mx

from mlxd.engine.schedule.memory import memory_status

if TYPE_CHECKING:
    from mlxd.engine.engine import BatchedEngine


def engine_status(engine: BatchedEngine, prompts: bool = False) -> dict[str, Any]:
    """Requests, limits, totals, step times and memory. Rendered prompts (clipped) are shown only when ``prompts``
    asks for them."""
    with engine.core.table.lock:
        pending = [s.state for s in engine.core.table.pending.values()]
        running, waiting = list(engine.scheduler.running), list(engine.scheduler.waiting)
    drafter, vision = engine.drafter, engine.core.runner.vision
    return {
        **({"vision": vision.status()} if vision is not None else {}),
        "running": [s.snapshot(prompts) for s in running],
        "waiting": [s.snapshot(prompts) for s in [*waiting, *pending]],
        "limits": {
            "max_running": engine.config.max_running,
            "max_running_source": engine.core.running_limit.source,
            "max_waiting": engine.config.max_waiting,
            "step_token_budget": engine.config.step_token_budget,
        },
        "totals": dict(engine.totals),
        "speculative": speculative_status(engine.totals, drafter.name if drafter is not None else None),
        "step_ms": engine.step_times.status(), "num_steps": engine.step_times.num_steps,
        "memory": {
            "active_bytes": mx.get_active_memory(),
            "peak_bytes": mx.get_peak_memory(),
            "cache_bytes": mx.get_cache_memory(),
            # Admission: the limit, the weights' share, what requests reserve, what the prefix cache holds.
            **(memory_status(engine.memory, engine.scheduler.num_reserved_bytes, engine.reuse.num_bytes)
               if engine.memory is not None else {}),
        },
        **({"distributed": engine.leader.status()} if engine.leader is not None else {}),
        **({"prefix_disk": disk} if (disk := engine.reuse.stats().get("disk")) is not None else {}),
    }

def speculative_status(totals: dict[str, Any], drafter: str | None) -> dict[str, Any]:
    """The drafter, and what speculative requests that ended got from it."""
    drafted, steps = totals["speculative_drafted"], totals["speculative_steps"]
    return {
        "drafter": drafter,
        "acceptance": round(totals["speculative_accepted"] / drafted, 3) if drafted else None,
        "tokens_per_step": round(totals["speculative_emitted"] / steps, 2) if steps else None,
        "drafter_ms": round(totals["speculative_drafter_ms"], 1),
    }
