"""The step runner: the MLX side of a step. It holds the decode batch, the rows whose prompts are still going in,
and the vision prefill, and runs a planned step's prompt chunks and decode step.

Prompt chunks run one request at a time (:func:`process_prompt`), or, for a group the scheduler planned together,
in one forward pass (whole text prompts, whole image prompts, the rests of prompts that start from a cached state);
a prompt that completes joins the :class:`DecodeBatch`. A request whose row cannot be built, or whose chunk fails,
fails alone (``fail``, the engine's); a group's failed pass is retried one prompt at a time, except in a distributed
group (``share`` given), whose other ranks cannot follow a retry.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import mlx.core as mx

from mlxd.cache.quantized import kv_quantization
from mlxd.config.schema import EngineConfig
from mlxd.engine.base import EngineRequest, Progress, SamplingParams, Speculative
from mlxd.engine.drafters.base import Drafter
from mlxd.engine.prefix import PromptReuse
from mlxd.engine.requests import RequestTable, Submitted
from mlxd.engine.schedule.scheduler import Scheduler
from mlxd.engine.speculative.state import SpecState
from mlxd.engine.speculative.step import check_drafter
from mlxd.engine.step.batch import DecodeBatch
from mlxd.engine.step.buckets import make_buckets
from mlxd.engine.step.prompts import (
    can_batch_prompts,
    can_batch_vision_prompts,
    can_continue_together,
    process_continuations,
    process_prompt,
    process_prompts,
    process_vision_prompts,
    same,
)
from mlxd.engine.step.row import Refused, Row, check_request, logits_width, reset_random_state
from mlxd.engine.step.vision import VisionPrefill
from mlxd.engine.step.warmup import warm_up_shapes, warm_up_verify
from mlxd.log import get_logger

log = get_logger("mlxd.engine")

Fail = Callable[[str, str, Exception], None]  # (request id, phase, error): the engine ends that request


class StepRunner:
    """Runs steps over the decode batch; ``fail`` ends a request that failed here (the engine's)."""

    def __init__(self, model: Any, config: EngineConfig, *, table: RequestTable, scheduler: Scheduler,
                 reuse: PromptReuse, fail: Fail, make_sampler: Callable[[SamplingParams], Any],
                 drafter: Drafter | None, share: Callable[[mx.array], mx.array] | None, trimmable: bool,
                 vision: VisionPrefill | None) -> None:
        self.model, self.config, self.drafter = model, config, drafter
        self._table, self._scheduler, self._reuse, self._fail = table, scheduler, reuse, fail
        self._make_sampler = make_sampler
        self._retry_groups = share is None
        self.batch = DecodeBatch(model, share=share or same)
        self.trimmable = trimmable
        self.vision = vision
        self.prefilling: dict[str, Row] = {}  # rows whose prompt is still going in, each with its own cache
        self.vocab_size = 0  # the model's logits width, learned at warm-up: token ids must be below it

    def warm_up(self) -> None:
        """Learn the logits width, check the drafter, and run the shapes serving will use."""
        self.vocab_size = logits_width(self.model)
        if self.drafter is not None:
            check_drafter(self.drafter, self.model, self.config, self.vocab_size)
        self.batch.buckets = make_buckets(self.config.max_running, self.config.batch_buckets)
        warm_up_shapes(self.model, self.config, buckets=self.batch.buckets)
        if self.drafter is not None:
            warm_up_verify(self.model, self.config)

    # ---- rows ----

    def forget(self, request_id: str) -> None:
        """A request ended: its row leaves (the batch's or its prompt's), and it waits for no image."""
        self.batch.remove({request_id})
        self.prefilling.pop(request_id, None)
        if self.vision is not None:
            self.vision.forget(request_id)

    def clear(self) -> None:
        """Drop every row without touching MLX state (the engine may be broken)."""
        self.batch.clear()
        self.prefilling.clear()

    def start_from(self, submitted: Submitted, cache: list[Any]) -> None:
        """Build the row of a request whose prompt starts from a cached state (``num_prefilled`` tokens)."""
        request = submitted.request
        row = self._new_row(submitted, cache)
        if row.processors:
            row.history = mx.array(request.prompt[: submitted.state.num_prefilled], dtype=mx.uint32)

    def _build_row(self, submitted: Submitted) -> Row | None:
        """The row of a request starting its prompt; ``None`` when it cannot be built (the request failed)."""
        try:
            return self._new_row(submitted)
        except Exception as e:  # noqa: BLE001 - this request fails with it (reported, not swallowed)
            self._fail(submitted.request.request_id, "build", e)
            return None

    def _new_row(self, submitted: Submitted, cache: list[Any] | None = None) -> Row:
        request = submitted.request
        params = check_request(request, self.vocab_size)
        constraints = request.logits_processors() if request.logits_processors is not None else None
        row = Row.for_request(request.request_id, params, self.model, self.config.max_kv_size, cache,
                              make_sampler=self._make_sampler, extra_processors=constraints,
                              num_logprobs=request.num_logprobs, kv=kv_quantization(self.config))
        row.spec = self._spec_state(request)
        if row.spec is not None:
            submitted.state.decode = row.spec.summary
        if submitted.state.vision:  # the route's decision (checked against the model when it was accepted)
            row.vision = self.vision.prepare(request)
        self.prefilling[request.request_id] = row
        return row

    def _spec_state(self, request: EngineRequest) -> SpecState | None:
        """A speculative request's row state; None for plain ones (their reason is the route's)."""
        mode = request.decode
        if not isinstance(mode, Speculative) or self.drafter is None:
            return None
        if mode.drafter != self.drafter.name:
            raise Refused(f"this server drafts with {self.drafter.name!r}, not {mode.drafter!r}")
        settings = self.config.speculative
        return SpecState.for_request(mode, self.drafter, request.prompt, request.max_tokens,
                                     min_acceptance=settings.min_acceptance, max_step_tokens=settings.max_step_tokens)

    # ---- prompts ----

    def run_prompts(self, chunks: list[tuple[Submitted, int]], groups: list[list[Submitted]]) -> None:
        """A step's prompt chunks: alone, or in the groups that share one forward pass each."""
        if self.vision is not None and self.vision.encoder is None:
            self._encode_images_ahead(chunks)
        together = {submitted.request.request_id for group in groups for submitted in group}
        for submitted, num_tokens in chunks:
            if submitted.request.request_id not in together:
                self._prefill(submitted, num_tokens)
        for group in groups:
            self._prefill_together(group)
        if chunks:
            self.batch.costs.interrupt()

    def _encode_images_ahead(self, chunks: list[tuple[Submitted, int]]) -> None:
        """When an image request's prompt starts, the images of every image request not started yet go through the
        vision tower together (one call, not one each: :meth:`VisionPrefill.encode_ahead`). Should that call fail,
        each request encodes its own images as it starts, so that only a request whose image fails fails."""
        def unstarted_image_request(submitted: Submitted) -> bool:
            return (submitted.state.vision and submitted.request.request_id not in self.prefilling
                    and submitted.state.num_prefilled == 0)

        if not any(unstarted_image_request(s) for s, _ in chunks):
            return
        waiting = [self._table[r].request for r in self._table if unstarted_image_request(self._table[r])]
        try:
            self.vision.encode_ahead(waiting)
        except Exception as e:  # noqa: BLE001 - each request then encodes its own images (reported there)
            log.warning("encode_ahead_failed", request_ids=[r.request_id for r in waiting],
                        error_type=type(e).__name__, error=str(e))

    def _prefill(self, submitted: Submitted, num_tokens: int) -> None:
        """Process one prompt chunk; a request whose prompt is complete joins the decode batch."""
        request, state = submitted.request, submitted.state
        submitted.started_at = submitted.started_at or time.monotonic()
        row = self.prefilling.get(request.request_id) or self._build_row(submitted)
        if row is None:
            return
        start = state.num_prefilled
        num_tokens = self._reuse.chunk_end(start, num_tokens, request.checkpoints, self.trimmable)
        end = start + num_tokens
        try:
            first = process_prompt(self.model, row, request.prompt[start:end], last=end == len(request.prompt),
                                   start=start, share=self.batch.share)
            if first is None:  # a chunk boundary: keep the work, even if the request is cancelled later
                self._reuse.keep_chunk(submitted.cache_key, start, end, row.cache, checkpoints=request.checkpoints,
                                       num_cached=state.num_cached_tokens)
        except Exception as e:  # noqa: BLE001 - this request fails with it (reported, not swallowed)
            self._fail(request.request_id, "prefill", e)
            return
        self._scheduler.on_prefilled(state, num_tokens)
        self._table.post(submitted, Progress(state.num_prefilled, state.num_prompt_tokens))
        if first is not None:
            del self.prefilling[request.request_id]
            row.release_prompt()
            if request.keep_prompt:
                mx.eval([c.state for c in row.cache])
                self._reuse.keep(submitted.cache_key, row.cache)
            self.batch.add(row, first)

    def _prefill_together(self, group: list[Submitted]) -> None:
        """Process a group of prompts of one kind in one forward pass: whole text prompts, whole image prompts,
        or the rests of prompts that start from a cached state; the group joins the decode batch together. A
        request whose prompt state is kept for its siblings (``keep_prompt``) continues alone."""
        now = time.monotonic()
        for submitted in group:
            submitted.started_at = now
        share, buckets = self.batch.share, self.batch.buckets
        if group[0].state.num_prefilled:
            for submitted in [s for s in group if s.request.keep_prompt]:
                self._prefill(submitted, submitted.state.num_prompt_remaining)
            self._run_group([s for s in group if not s.request.keep_prompt], can_continue_together,
                            lambda rows, subs: process_continuations(
                                self.model, rows, [s.request.prompt[s.state.num_prefilled:] for s in subs],
                                share=share, buckets=buckets))
        elif group[0].state.vision:
            self._run_group(group, can_batch_vision_prompts, lambda rows, subs: process_vision_prompts(
                self.model, rows, [s.request.prompt for s in subs], share=share))
        else:
            self._run_group(group, can_batch_prompts, lambda rows, subs: process_prompts(
                self.model, rows, [s.request.prompt for s in subs], share=share, buckets=buckets))

    def _run_group(self, group: list[Submitted], can_group: Callable[[list[Row]], bool],
                   run: Callable[[list[Row], list[Submitted]], tuple[list[Any], mx.array]]) -> None:
        """One forward pass for ``group``'s prompts (``run(rows, group)``), or one each when ``can_group`` says no
        or the pass fails. A request whose row cannot be built has failed; the others go on."""
        if not group:
            return
        built = [(s, self.prefilling.get(s.request.request_id) or self._build_row(s)) for s in group]
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
            self._retry_one_by_one(group, e)
            return
        for submitted in group:
            state = submitted.state
            self._scheduler.on_prefilled(state, state.num_prompt_remaining)
            self._table.post(submitted, Progress(state.num_prefilled, state.num_prompt_tokens))
            del self.prefilling[submitted.request.request_id]
        for row in rows:
            row.release_prompt()
        self.batch.add_batch(rows, cache, first)

    def _retry_one_by_one(self, group: list[Submitted], error: Exception) -> None:
        log.warning("prompt_group_failed", request_ids=[s.request.request_id for s in group],
                    error_type=type(error).__name__, error=str(error))
        reset_random_state()
        for submitted in group:
            if not submitted.state.num_prefilled:  # a fresh row: the pass may have touched it
                self.prefilling.pop(submitted.request.request_id)
            self._prefill(submitted, submitted.state.num_prompt_remaining)

    # ---- decode ----

    def decode(self) -> tuple[list[list[int]], float]:
        """One decode step of every decoding row: each row's emitted tokens, in row order, and the seconds spent
        waiting for the device. When the shared step fails, every decoding request fails (the batch is reset) and
        nothing is emitted."""
        if not len(self.batch):
            return [], 0.0
        try:
            return self.batch.step(), self.batch.waited_s
        except Exception as e:  # noqa: BLE001 - every decoding request fails with it (reported, not swallowed)
            request_ids = self.batch.request_ids
            self.batch.clear()  # a failed step can leave the batched cache unusable
            for request_id in request_ids:
                self._fail(request_id, "decode", e)
            return [], 0.0
