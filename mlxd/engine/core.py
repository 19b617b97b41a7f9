"""The engine's core: the parts it owns, and the one :meth:`EngineCore.apply` through which commands change them.

- the request table (:mod:`mlxd.engine.requests`): every request's state and its event channel;
- the scheduler (:mod:`mlxd.engine.schedule.scheduler`): waiting and running requests, prompt passes;
- memory admission (:mod:`mlxd.engine.schedule.memory`): what requests and the prefix cache may hold;
- prefix reuse (:mod:`mlxd.engine.prefix`): lookup, keep and evict over the prefix cache;
- the step runner (:mod:`mlxd.engine.step.runner`): the decode batch, prompt passes and vision prefill (MLX);
- failures (:mod:`mlxd.engine.failures`): how a request that fails or waits too long ends.

The limits resolved at warm-up (the memory budget, ``max_running``) are :mod:`mlxd.engine.limits`'s.

No thread of its own: :class:`mlxd.engine.engine.BatchedEngine` runs it on the engine thread, a distributed
follower in its loop, a test straight from a list of commands. Decisions that only one place makes (which
requests finish, time out or fail, what the next step runs, when the prefix cache must shrink) are made here by
the core that *serves* (``follower`` off) and applied as commands, so that whoever records them can replay them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import mlx.core as mx

from mlxd.cache.disk import make_disk_tier
from mlxd.cache.prefix_cache import Hit
from mlxd.cache.quantized import kv_quantization
from mlxd.config.schema import EngineConfig
from mlxd.engine.base import Failed, Plain, SamplingParams
from mlxd.engine.commands import (
    Accept,
    Cancel,
    Clear,
    Command,
    Drop,
    EndAll,
    Evict,
    ImagesEncoded,
    Keep,
    RunStep,
    Stop,
)
from mlxd.engine.drafters.base import Drafter
from mlxd.engine.failures import Failures
from mlxd.engine.limits import log_memory_budget, resolve_max_running
from mlxd.engine.prefix import PromptReuse, is_trimmable
from mlxd.engine.requests import RequestTable, Submitted
from mlxd.engine.schedule.memory import MemoryBudget, RunningLimit, max_pass_tokens, measure_memory
from mlxd.engine.schedule.scheduler import Scheduler, SequenceState, prompts_to_batch
from mlxd.engine.step.prompts import group_bucket
from mlxd.engine.step.row import Refused, make_request_cache
from mlxd.engine.step.runner import StepRunner
from mlxd.engine.step.steptimes import StepTimes
from mlxd.engine.step.vision import VisionPrefill, prompt_key
from mlxd.runtime.progress import phase


class Group(Protocol):
    """What the core needs of a distributed group (:class:`mlxd.engine.distributed.channel.Channel`): this rank's
    number, and rank 0's sampled tokens shared inside a step's graph."""

    rank: int

    def share_tokens(self, tokens: mx.array) -> mx.array: ...


class EngineCore:
    """The engine's parts and state. ``record`` (a distributed leader's) sees every command before it is applied.

    ``channel``: a distributed group's (rank 0's tokens shared, no retry a peer could not follow, and a failure
    other than a refusal ends the job). ``follower``: rows end only when a command says so; nobody listens."""

    def __init__(self, model: Any, config: EngineConfig, *, make_sampler: Callable[[SamplingParams], Any],
                 drafter: Drafter | None = None, channel: Group | None = None, follower: bool = False,
                 deliver: Callable[[Any], None] | None = None,
                 record: Callable[[Command], None] | None = None) -> None:
        self.config = config
        self.table = RequestTable(config.stream_updates_per_s)
        # max_running 0: derived from the memory budget at warm-up (until then one row).
        self.scheduler = Scheduler(max_running=config.max_running or 1, max_waiting=config.max_waiting,
                                   step_token_budget=config.step_token_budget)
        self.reuse = PromptReuse(config.prefix_cache_bytes, config.prefix_cache_min_tokens, align=group_bucket())
        self.memory: MemoryBudget | None = None  # measured at warm-up
        # max_running and where it came from (the config, or derived from the memory budget at warm-up).
        self.running_limit = RunningLimit(config.max_running, "config" if config.max_running else "derived")
        vision = (VisionPrefill(model, config.vision_feature_cache_bytes, deliver if channel is None else None)
                  if hasattr(model, "encode") else None)
        self.runner = StepRunner(model, config, table=self.table, scheduler=self.scheduler, reuse=self.reuse,
                                 fail=self.fail, make_sampler=make_sampler, drafter=drafter,
                                 share=channel.share_tokens if channel is not None else None,
                                 trimmable=is_trimmable(make_request_cache(model, config.max_kv_size)),
                                 vision=vision)
        self.step_times = StepTimes()
        self.failures = Failures(self.table, self.reuse, self.runner, apply=self.apply,
                                 rank=channel.rank if channel is not None else None)
        self._record = record
        self._channel = channel
        self._follower = follower
        self._handlers: dict[type, Callable[[Any], Any]] = {
            Accept: self._accept, Cancel: self._cancel, Keep: self._keep, Drop: self._drop, Evict: self._evict,
            Clear: self._clear, EndAll: self._end_all, Stop: self._stop, RunStep: self._run_step,
            ImagesEncoded: self._images_encoded,
        }

    @property
    def totals(self) -> dict[str, Any]:
        return self.table.totals

    def apply(self, command: Command | ImagesEncoded) -> Any:
        """Apply one command: the only way the engine's state changes. Returns what ``Clear`` and ``Drop`` give
        back (the prefix cache's stats before; the request let go), else None."""
        if self._record is not None and not isinstance(command, ImagesEncoded):
            self._record(command)
        return self._handlers[type(command)](command)

    def warm_up(self) -> None:
        """Measure what admission counts (the weights and a request's cache, :mod:`mlxd.engine.schedule.memory`)
        and the logits width, then run the shapes serving will use."""
        model = self.runner.model
        self.memory = measure_memory(model, limit_bytes=self.config.memory_limit_bytes,
                                     max_kv_size=self.config.max_kv_size, kv=kv_quantization(self.config))
        self.scheduler.kv_budget_bytes = self.memory.kv_budget_bytes
        if self.reuse.cache is not None and self._channel is None:  # [distributed] has no disk tier (config says so)
            self.reuse.cache.attach_disk(make_disk_tier(self.config, model))
        # Whole prompts share a pass only where caches can be merged left-padded (trimmable: prompts_to_batch);
        # elsewhere a burst would run one pass per prompt in a single step, and decoding rows would wait for all.
        self.scheduler.max_pass_tokens = (max_pass_tokens(self.memory, self.config.step_token_budget)
                                          if self.runner.trimmable else 0)
        self.scheduler.pass_bytes_per_token = self.memory.pass_bytes_per_token
        mx.set_cache_limit(self.memory.cache_limit_bytes)
        log_memory_budget(self.memory, self.scheduler.max_pass_tokens)
        # max_running as set, or derived from the memory budget: the config then holds the number (warm-up meets
        # batches up to it).
        self.running_limit, self.config = resolve_max_running(self.config, self.memory)
        self.runner.config = self.config
        self.scheduler.max_running = self.running_limit.max_running
        with phase("warm_up", max_running=self.config.max_running):
            self.runner.warm_up()
        buckets = self.runner.batch.buckets
        if buckets is not None and buckets.decode:  # the decode batch pads its rows to a bucket: admission counts it
            self.scheduler.row_width = buckets.width

    # ---- what the serving core decides ----

    def plan(self) -> RunStep:
        """The next step: make room (the prefix cache gives way first), then the scheduler's plan, with the groups
        of prompts that share one forward pass each (not where snapshots must land on checkpoints)."""
        self._make_room()
        plan = self.scheduler.schedule()
        groups = prompts_to_batch(plan.prefill) if self.runner.trimmable else []
        return RunStep([(state.request_id, n) for state, n in plan.prefill],
                       [[state.request_id for state in group] for group in groups])

    def _make_room(self) -> None:
        """The prefix cache keeps what the running requests (and the head of the queue, when it can then be
        admitted) leave of the memory budget; the requests may reserve the rest."""
        if self.memory is None:
            return
        budget = self.memory.kv_budget_bytes
        room = budget - self.scheduler.num_bytes_needed(budget)
        if self.reuse.num_bytes > room:
            self.apply(Evict(room))
        self.scheduler.kv_budget_bytes = budget - self.reuse.num_bytes

    def fail(self, request_id: str, phase: str, error: Exception) -> None:
        """End one request that failed in ``phase`` (:meth:`mlxd.engine.failures.Failures.fail`: retried cold once
        when it started from a prefix-cache hit, else ``Failed``, 500)."""
        self.failures.fail(request_id, phase, error)

    def expire_waiting(self) -> None:
        """End the requests that have waited in the queue longer than ``max_queue_wait_s`` (503)."""
        self.failures.expire_waiting(self.scheduler.waiting, self.config.max_queue_wait_s)

    def end_all(self, message: str) -> None:
        """End every request, pending ones included, with ``Failed(message, 503)``. Touches no MLX state: the
        engine may be broken."""
        with self.table.lock:
            ended = self.table.take_all()
            self.scheduler.waiting.clear()
            self.scheduler.running.clear()
        for submitted in ended:
            self.table.post(submitted, Failed(message, status=503))
        self.totals["num_aborted"] += len(ended)
        self.runner.clear()

    # ---- the commands ----

    def _accept(self, command: Accept) -> None:
        request_id = command.spec.request_id
        with self.table.lock:
            submitted = self.table.pending.get(request_id)
        if submitted is None:  # sent by a leader (or replayed): nobody here listens to it
            request = command.spec.request()
            submitted = Submitted(request, None, SequenceState.for_request(request))
        self.table.hold(submitted)
        mode = submitted.request.decode
        submitted.state.decode = ({"mode": "plain", "reason": mode.reason} if isinstance(mode, Plain)
                                  else {"mode": "speculative", "drafter": mode.drafter, "k": mode.k})
        try:
            if submitted.state.vision:  # the route stage's decision, carried on the request (never decided again)
                submitted.state.encoding = self._vision().hold(submitted.request)
            submitted.cache_key = prompt_key(submitted.request)
            self._start_after(submitted, self.reuse.lookup(submitted.cache_key, align=not submitted.state.vision))
        except Exception as e:  # noqa: BLE001 - this request fails with it (reported, not swallowed)
            with self.table.lock:
                self.table.pending.pop(request_id, None)
            self.fail(request_id, "build", e)
            return
        with self.table.lock:
            self.table.pending.pop(request_id, None)
            self.scheduler.add(submitted.state)

    def _vision(self) -> VisionPrefill:
        """The vision prefill, for a request routed ``vision``; a model without one refuses it."""
        if self.runner.vision is None:
            raise Refused("this model does not accept images")
        return self.runner.vision

    def _start_after(self, submitted: Submitted, hit: Hit) -> None:
        """Start the prompt after the longest state the prefix cache holds for it (``hit``; a miss: at its start).
        That may be where an earlier request with the same prompt stopped when its client left: the chunks it
        finished were kept (:meth:`mlxd.engine.prefix.PromptReuse.keep`)."""
        state = submitted.state
        state.cache_hit, state.num_cached_tokens = hit.kind, hit.num_cached
        if hit.cache is None:
            return
        self.failures.started_from(submitted.request.request_id, hit.entry)
        state.num_prefilled = hit.num_cached
        if state.encoding:  # the row merges the images' features: it is built once they are in
            submitted.start_cache = hit.cache
        else:
            self.runner.start_from(submitted, hit.cache)

    def _cancel(self, command: Cancel) -> None:
        request_id = command.request_id
        if request_id not in self.table:
            return  # already finished: cancel is idempotent
        if request_id in self.runner.batch.request_ids:
            self._keep(Keep(request_id))
        if command.reason == "cancelled":
            self.totals["num_cancelled"] += 1
        submitted = self._drop(Drop(request_id))
        self.table.post_finished(submitted, command.reason)

    def _keep(self, command: Keep) -> None:
        """Snapshot a decoding request's prompt + generated tokens (finished or cancelled) for later turns."""
        submitted = self.table.get(command.request_id)
        if submitted is not None and self.reuse.cache is not None:
            self.reuse.keep(submitted.cache_key + submitted.generated, self.runner.batch.row_cache(command.request_id))

    def _drop(self, command: Drop) -> Submitted | None:
        """Forget a request everywhere: its row, the scheduler's queues, the request table."""
        self.failures.forget(command.request_id)
        self.runner.forget(command.request_id)
        self.scheduler.remove(command.request_id)
        return self.table.pop(command.request_id)

    def _evict(self, command: Evict) -> None:
        self.reuse.shrink(command.num_bytes)

    def _clear(self, command: Clear) -> dict[str, Any]:
        return self.reuse.clear()

    def _end_all(self, command: EndAll) -> None:
        self.end_all(command.message)

    def _stop(self, command: Stop) -> None:
        self.end_all("the server is shutting down; retry shortly")

    def _images_encoded(self, command: ImagesEncoded) -> None:
        """The encoder thread finished a job: the requests whose images are now all in may start (those starting
        from a prefix-cache state get their rows now)."""
        for request_id in self.runner.vision.take(command.encoded):
            submitted = self.table.get(request_id)
            if submitted is None:
                continue
            submitted.state.encoding = False
            cache, submitted.start_cache = submitted.start_cache, None
            if cache is not None:
                try:
                    self.runner.start_from(submitted, cache)
                except Exception as e:  # noqa: BLE001 - this request fails with it (reported, not swallowed)
                    self.fail(request_id, "build", e)

    def _run_step(self, command: RunStep) -> None:
        """Run a planned step: its prompt chunks, the decode step, then post-processing."""
        clock, table = self.step_times, self.table
        chunks = [(table[request_id], n) for request_id, n in command.prefill]
        for submitted, _ in chunks:
            self.scheduler.start(submitted.state)  # admitted already where the plan was made
        self.runner.run_prompts(chunks, [[table[request_id] for request_id in group] for group in command.together])
        clock.lap("prefill")
        tokens, waited_s = self.runner.decode()
        clock.lap("decode_build", waited_s)
        self._post_process(tokens)
        clock.lap("post_process")
        self.totals["num_steps"] += 1

    def _post_process(self, tokens: list[list[int]]) -> None:
        """Emit each row's tokens; finish the rows that hit a stop token or their ``max_tokens``. A follower only
        records what each row fed (the leader decides which rows end, and says so)."""
        batch = self.runner.batch
        if self._follower:
            for row, emitted in zip(batch.rows, tokens, strict=True):
                self.table[row.request_id].generated.extend(emitted)
            return
        finished: dict[str, str] = {}
        for row, emitted in zip(batch.rows, tokens, strict=True):
            submitted = self.table[row.request_id]
            reason, unsent = self.table.emit_all(submitted, emitted, batch.logprobs.get(row.request_id))
            if reason is not None:
                finished[row.request_id] = reason
                if row.spec is not None:
                    row.spec.emitted -= unsent
            elif row.spec is not None:
                submitted.state.num_feeding = 1 + row.spec.k
        if finished:
            for request_id in finished:
                self.apply(Keep(request_id))
            batch.remove(set(finished))  # the rows leave together: one filter of the batched cache, not one each
            for request_id, reason in finished.items():
                self.table.post_finished(self.apply(Drop(request_id)), reason)
        if batch.errors:  # rows whose next token could not be computed; the tokens they got stand
            errors, batch.errors = batch.errors, {}
            for request_id, error in errors.items():
                self.fail(request_id, "sample", error)
