"""The batching engine: continuous batching on one engine thread.

Every MLX call happens on the engine thread. The event loop only puts commands in the inbox (submit, cancel, stop)
and reads events from each request's :class:`RequestHandle`; the engine thread applies the commands between steps,
so a cancelled request leaves the batch within one prompt chunk or one decode step.

One :meth:`BatchedEngine.step` is: schedule (:class:`Scheduler`, plain Python) → run the batch (prompt chunks, whole
short prompts together in one pass, then one decode step for every decoding request) → post-process (emit tokens,
finish requests, free their rows).

A failure ends only the requests it must, with ``Failed`` and one ``request_failed`` log line each: the one request
whose row could not be built, whose prompt chunk or sampler raised (a group of prompts processed together is retried
one by one); every decoding request when the shared decode step breaks. The loop goes on, with MLX's random state
and the decode batch reset. Should the thread end anyway, :attr:`BatchedEngine.failure` says why, every request ends
with a 503 ``Failed``, :meth:`BatchedEngine.submit` refuses, and ``on_failure`` is called.
How requests come in (the inbox's commands, a submitted request taken on) is :mod:`mlxd.engine.intake`; how they
end (events, finishing, failing, cancelling, timing out) is :mod:`mlxd.engine.outcomes`; the event loop's side is
:mod:`mlxd.engine.front`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import mlx.core as mx
from mlx_lm.generate import generation_stream

from mlxd.config.schema import EngineConfig
from mlxd.engine.base import (
    EngineRequest,
    Progress,
    SamplingParams,
    Speculative,
)
from mlxd.engine.drafters.base import Drafter
from mlxd.engine.front import Submitted
from mlxd.engine.intake import Intake
from mlxd.engine.prefix import is_trimmable
from mlxd.engine.schedule.memory import measure_memory
from mlxd.engine.schedule.scheduler import SequenceState, StepPlan, prompts_to_batch
from mlxd.engine.speculative.state import SpecState
from mlxd.engine.speculative.step import check_drafter
from mlxd.engine.step.batch import DecodeBatch
from mlxd.engine.step.prompts import (
    can_batch_prompts,
    can_batch_vision_prompts,
    can_continue_together,
    process_continuations,
    process_prompt,
    process_prompts,
    process_vision_prompts,
)
from mlxd.engine.step.row import (
    Refused,
    Row,
    check_request,
    logits_width,
    make_request_cache,
    reset_random_state,
)
from mlxd.engine.step.sampling import make_request_sampler
from mlxd.engine.step.steptimes import StepTimes
from mlxd.engine.step.vision import VisionPrefill
from mlxd.engine.step.warmup import warm_up_shapes, warm_up_verify
from mlxd.log import get_logger

log = get_logger("mlxd.engine")


class BatchedEngine(Intake):
    """Serves many requests at once: chunked prompt processing interleaved with batched decode steps."""

    # A group of prompts whose shared pass failed is retried one prompt at a time (not in a distributed group,
    # where the other ranks cannot follow a retry).
    _retry_groups = True
    # Images are encoded on a thread of their own while the engine steps (:mod:`mlxd.engine.step.encoder`); not in a
    # distributed group, whose ranks must run the same work in the same step.
    _encode_beside = True

    def __init__(self, model: Any, config: EngineConfig, *,
                 make_sampler: Callable[[SamplingParams], Any] = make_request_sampler,
                 drafter: Drafter | None = None) -> None:
        """``make_sampler`` builds each request's sampler (mlx-lm's by default); ``drafter`` proposes tokens for
        speculative requests (:mod:`mlxd.engine.drafters`), None: every request decodes plain."""
        super().__init__(config)
        self.model = model
        self.drafter = drafter
        self.step_times = StepTimes()
        self._make_sampler = make_sampler
        self.vocab_size = 0  # the model's logits width, learned at warm-up: token ids must be below it
        self.batch = DecodeBatch(model)
        # Caches that cannot be trimmed (recurrent layers) hit only where snapshotted: at checkpoints.
        self._trimmable = is_trimmable(make_request_cache(model, config.max_kv_size))
        # Vision-language models: image features (cached by image digest) merged into vision rows' prompts.
        beside = self._encode_beside and config.vision_encoder_thread
        deliver = (lambda encoded: self._inbox.put(("encoded", encoded))) if beside else None
        self.vision = (VisionPrefill(model, config.vision_feature_cache_bytes, deliver)
                       if hasattr(model, "encode") else None)

    # ---- engine thread (the event-loop side is EngineFront) ----

    def _run(self) -> None:
        if self.vision is not None:
            self.vision.start()
        try:
            with mx.stream(generation_stream):
                self._serve()
            mx.synchronize(generation_stream)  # nothing of ours may still be running when the thread ends
        except BaseException as e:  # noqa: BLE001 - the engine is gone: its requests and its owner are told
            self._die(e)
        finally:
            if self.vision is not None:
                self.vision.stop()

    def _serve(self) -> None:
        try:
            self._warm_up()
        except Exception as e:  # noqa: BLE001 - handed to start(), which re-raises it
            self._startup_error = e
        self._ready.set()
        if self._startup_error is not None:
            return
        try:
            # Blocking on the inbox only while idle, the queue-wait check runs every iteration it matters in.
            while self._apply_inbox(block=not self.scheduler.has_work):
                self._expire_waiting()
                if self.scheduler.has_work:
                    self.step()
                else:
                    self._idle()
                self._send()
        finally:
            self._send()

    def _warm_up(self) -> None:
        """Measure what admission counts (the weights and a request's cache, :mod:`mlxd.engine.schedule.memory`) and the
        logits width, then run the shapes serving will use (:func:`warm_up_shapes`)."""
        self.memory = measure_memory(self.model, limit_bytes=self.config.memory_limit_bytes,
                                     max_kv_size=self.config.max_kv_size)
        self.scheduler.kv_budget_bytes = self.memory.kv_budget_bytes
        mx.set_cache_limit(self.memory.cache_limit_bytes)
        log.info("memory_budget", limit_bytes=self.memory.limit_bytes, weights_bytes=self.memory.weights_bytes,
                 kv_bytes_per_token=self.memory.kv.num_bytes_per_token_total,
                 kv_fixed_bytes=self.memory.kv.num_fixed_bytes, cache_limit_bytes=self.memory.cache_limit_bytes)
        self.vocab_size = logits_width(self.model)
        if self.drafter is not None:
            check_drafter(self.drafter, self.model, self.config, self.vocab_size)
        warm_up_shapes(self.model, self.config)
        if self.drafter is not None:
            warm_up_verify(self.model, self.config)

    def _idle(self) -> None:
        mx.clear_cache()  # idle: give the freed buffers back

    def step(self) -> None:
        """One engine step: schedule → run the batch → post-process (each phase timed: :mod:`.steptimes`)."""
        clock = self.step_times
        clock.start()
        plan, together = self._plan_step()
        clock.lap("schedule")
        self._run_plan(plan, together)

    def _plan_step(self) -> tuple[StepPlan, list[list[SequenceState]]]:
        """This step's plan (the scheduler's), and the groups of prompts that share one forward pass each (not
        where snapshots must land on checkpoints)."""
        self._make_room()
        plan = self.scheduler.schedule()
        return plan, prompts_to_batch(plan.prefill) if self._trimmable else []

    def _run_plan(self, plan: StepPlan, groups: list[list[SequenceState]]) -> None:
        """Run a planned step: its prompt chunks, the decode step, then post-processing."""
        clock = self.step_times
        if self.vision is not None and self.vision.encoder is None:
            self._encode_images_ahead(plan)
        together = {state.request_id for group in groups for state in group}
        for state, num_tokens in plan.prefill:
            if state.request_id not in together:
                self._prefill(self._requests[state.request_id], num_tokens)
        for group in groups:
            self._prefill_together([self._requests[state.request_id] for state in group])
        if plan.prefill:
            self.batch.costs.interrupt()
        clock.lap("prefill")
        self.batch.waited_s = 0.0
        tokens = self._decode()
        clock.lap("decode_build", self.batch.waited_s)
        self._post_process(tokens)
        clock.lap("post_process")
        self.totals["num_steps"] += 1

    def _encode_images_ahead(self, plan: StepPlan) -> None:
        """When an image request's prompt starts, the images of every image request not started yet go through the
        vision tower together (one call, not one each: :meth:`VisionPrefill.encode_ahead`). Should that call fail,
        each request encodes its own images as it starts, so that only a request whose image fails fails."""
        def unstarted_image_request(request_id: str) -> bool:
            submitted = self._requests[request_id]
            return (submitted.request.media is not None and request_id not in self._prefilling
                    and submitted.state.num_prefilled == 0)

        if not any(unstarted_image_request(s.request_id) for s, _ in plan.prefill):
            return
        waiting = [self._requests[r].request for r in self._requests if unstarted_image_request(r)]
        try:
            self.vision.encode_ahead(waiting)
        except Exception as e:  # noqa: BLE001 - each request then encodes its own images (reported there)
            log.warning("encode_ahead_failed", request_ids=[r.request_id for r in waiting],
                        error_type=type(e).__name__, error=str(e))

    def _make_room(self) -> int | None:
        """The prefix cache gives way first: it keeps what the running requests (and the head of the queue, when
        it can then be admitted) leave of the memory budget; the requests may reserve the rest. Returns the bytes
        the prefix cache was shrunk to, None when it was not."""
        if self.memory is None:
            return None
        budget = self.memory.kv_budget_bytes
        room = budget - self.scheduler.num_bytes_needed(budget)
        shrunk = None
        if self.reuse.num_bytes > room:
            self.reuse.shrink(room)
            shrunk = room
        self.scheduler.kv_budget_bytes = budget - self.reuse.num_bytes
        return shrunk

    def _prefill(self, submitted: Submitted, num_tokens: int) -> None:
        """Process one prompt chunk; a request whose prompt is complete joins the decode batch."""
        request, state = submitted.request, submitted.state
        submitted.started_at = submitted.started_at or time.monotonic()
        row = self._prefilling.get(request.request_id) or self._build_row(submitted)
        if row is None:
            return
        start = state.num_prefilled
        num_tokens = self.reuse.chunk_end(start, num_tokens, request.checkpoints, self._trimmable)
        end = start + num_tokens
        try:
            first = process_prompt(self.model, row, request.prompt[start:end], last=end == len(request.prompt),
                                   start=start, share=self.batch.share)
            if first is None:  # a chunk boundary: keep the work, even if the request is cancelled later
                self.reuse.keep(submitted.cache_key[:end], row.cache)
        except Exception as e:  # noqa: BLE001 - this request fails with it (reported, not swallowed)
            self._fail(request.request_id, "prefill", e)
            return
        self.scheduler.on_prefilled(state, num_tokens)
        self._post(submitted, Progress(state.num_prefilled, state.num_prompt_tokens))
        if first is not None:
            del self._prefilling[request.request_id]
            row.release_prompt()
            if request.keep_prompt:
                mx.eval([c.state for c in row.cache])
                self.reuse.keep(submitted.cache_key, row.cache)
            self.batch.add(row, first)

    def _prefill_together(self, group: list[Submitted]) -> None:
        """Process a group of prompts of one kind (:func:`prompts_to_batch`) in one forward pass: whole text
        prompts, whole image prompts, or the rests of prompts that start from a cached state; the group joins the
        decode batch together. A request whose prompt state is kept for its siblings (``keep_prompt``) continues
        alone. Should a pass fail, each prompt is processed alone, so that only the request that caused it fails."""
        now = time.monotonic()
        for submitted in group:
            submitted.started_at = now
        if group[0].state.num_prefilled:
            for submitted in [s for s in group if s.request.keep_prompt]:
                self._prefill(submitted, submitted.state.num_prompt_remaining)
            self._run_group([s for s in group if not s.request.keep_prompt], can_continue_together,
                            lambda rows, subs: process_continuations(
                                self.model, rows, [s.request.prompt[s.state.num_prefilled:] for s in subs],
                                share=self.batch.share))
        elif group[0].request.media is not None:
            self._run_group(group, can_batch_vision_prompts, lambda rows, subs: process_vision_prompts(
                self.model, rows, [s.request.prompt for s in subs], share=self.batch.share))
        else:
            self._run_group(group, can_batch_prompts, lambda rows, subs: process_prompts(
                self.model, rows, [s.request.prompt for s in subs], share=self.batch.share))

    def _run_group(self, group: list[Submitted], can_group: Callable[[list[Row]], bool],
                   run: Callable[[list[Row], list[Submitted]], tuple[list[Any], mx.array]]) -> None:
        """One forward pass for ``group``'s prompts (``run(rows, group)``), or one each when ``can_group`` says no
        or the pass fails. A request whose row cannot be built has failed; the others go on."""
        if not group:
            return
        built = [(s, self._prefilling.get(s.request.request_id) or self._build_row(s)) for s in group]
        group, rows = [s for s, row in built if row is not None], [row for _, row in built if row is not None]
        if not can_group(rows):
            for submitted in group:
                self._prefill(submitted, submitted.state.num_prompt_remaining)
            return
        try:
            cache, first = run(rows, group)
        except Exception as e:  # noqa: BLE001 - retried one by one; a request that fails again is reported
            if not self._retry_groups:
                raise
            log.warning("prompt_group_failed", request_ids=[s.request.request_id for s in group],
                        error_type=type(e).__name__, error=str(e))
            reset_random_state()
            for submitted in group:
                if not submitted.state.num_prefilled:  # a fresh row: the pass may have touched it
                    self._prefilling.pop(submitted.request.request_id)
                self._prefill(submitted, submitted.state.num_prompt_remaining)
            return
        for submitted in group:
            state = submitted.state
            self.scheduler.on_prefilled(state, state.num_prompt_remaining)
            self._post(submitted, Progress(state.num_prefilled, state.num_prompt_tokens))
            del self._prefilling[submitted.request.request_id]
        for row in rows:
            row.release_prompt()
        self.batch.add_batch(rows, cache, first)

    def _build_row(self, submitted: Submitted) -> Row | None:
        """The row of a request starting its prompt; ``None`` when it cannot be built (the request failed)."""
        try:
            return self._new_row(submitted.request)
        except Exception as e:  # noqa: BLE001 - this request fails with it (reported, not swallowed)
            self._fail(submitted.request.request_id, "build", e)
            return None

    def _new_row(self, request: EngineRequest, cache: list[Any] | None = None) -> Row:
        params = check_request(request, self.vocab_size)
        constraints = request.logits_processors() if request.logits_processors is not None else None
        row = Row.for_request(request.request_id, params, self.model, self.config.max_kv_size, cache,
                              make_sampler=self._make_sampler, extra_processors=constraints,
                              num_logprobs=request.num_logprobs)
        row.spec = self._spec_state(request)
        if request.media is not None:
            if self.vision is None:
                raise Refused("this model does not accept images")
            row.vision = self.vision.prepare(request)
        self._prefilling[request.request_id] = row
        return row

    def _spec_state(self, request: EngineRequest) -> SpecState | None:
        """A speculative request's row state; None for plain ones (their reason is the route's)."""
        mode = request.decode
        if not isinstance(mode, Speculative) or self.drafter is None:
            return None
        if mode.drafter != self.drafter.name:
            raise Refused(f"this server drafts with {self.drafter.name!r}, not {mode.drafter!r}")
        settings = self.config.speculative
        spec = SpecState.for_request(mode, self.drafter, request.prompt, request.max_tokens,
                                     min_acceptance=settings.min_acceptance,
                                     max_step_tokens=settings.max_step_tokens)
        self._requests[request.request_id].state.decode = spec.summary
        return spec

    def _decode(self) -> list[list[int]]:
        if not len(self.batch):
            return []
        try:
            return self.batch.step()
        except Exception as e:  # noqa: BLE001 - every decoding request fails with it (reported, not swallowed)
            request_ids = self.batch.request_ids
            self.batch.clear()  # a failed step can leave the batched cache unusable
            for request_id in request_ids:
                self._fail(request_id, "decode", e)
            return []
