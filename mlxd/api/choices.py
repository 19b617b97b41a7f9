"""Several choices for one request (``n`` > 1): sibling jobs and one stream of their events, tagged by index.

Siblings share the prepared prompt (rendered and tokenized once) and its prefix-cache state: the first choice runs
alone until its prompt is processed (its engine request keeps a snapshot of the prompt), then the others start
and find the prompt in the prefix cache. A seeded request's choice ``i`` samples with a seed derived from
(seed, i); choice 0 keeps the seed itself, so ``n`` = 1 and the first of ``n`` choices are the same.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

import msgspec

from mlxd.pipeline.events import KeepAlive
from mlxd.pipeline.job import Job
from mlxd.pipeline.pipeline import Pipeline

_END = object()


def derived_seed(seed: int, index: int) -> int:
    """Choice ``index``'s seed: the request's own for choice 0, else a 63-bit hash of (seed, index)."""
    if index == 0:
        return seed
    digest = hashlib.sha256(f"{seed}:{index}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


def siblings(job: Job, n: int) -> list[Job]:
    """``job`` (prepared) and ``n - 1`` copies with their own request ids, seeds and per-stream state."""
    if n == 1:
        return [job]
    assert job.engine_request is not None
    job.engine_request.keep_prompt = True
    jobs = [job]
    for index in range(1, n):
        sampling = job.sampling
        if sampling.seed is not None:
            sampling = msgspec.structs.replace(sampling, seed=derived_seed(sampling.seed, index))
        request_id = f"{job.request_id}-{index}"
        request = msgspec.structs.replace(job.engine_request, request_id=request_id, sampling=sampling,
                                          keep_prompt=False)
        jobs.append(dataclasses.replace(job, request_id=request_id, sampling=sampling, engine_request=request,
                                        extra=dict(job.extra)))
    return jobs


async def fan_in(pipeline: Pipeline, jobs: list[Job], first: AsyncIterator[Any]) -> AsyncIterator[tuple[int, Any]]:
    """The events of every sibling (``n`` > 1) as they come, tagged with the choice index. ``first`` is the
    leader's open stream; the others start once the leader has output (its prompt is in the prefix cache) or has
    ended. Closing this stream closes every sibling's (their engine requests end)."""
    queue: asyncio.Queue[Any] = asyncio.Queue()
    started = asyncio.Event()
    tasks = [asyncio.ensure_future(_pump(0, first, queue, started))]
    try:
        await started.wait()
        tasks += [asyncio.ensure_future(_pump(i, pipeline.stream(job), queue, None))
                  for i, job in enumerate(jobs[1:], start=1)]
        num_open = len(tasks)
        while num_open:
            item = await queue.get()
            if item is _END:
                num_open -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task


async def _pump(index: int, events: AsyncIterator[Any], queue: asyncio.Queue, started: asyncio.Event | None) -> None:
    try:
        async with aclosing(events):
            async for event in events:
                if started is not None and not isinstance(event, KeepAlive):
                    started.set()
                await queue.put((index, event))
    except Exception as e:  # noqa: BLE001 - handed to the consumer, which raises it
        await queue.put(e)
    finally:
        if started is not None:
            started.set()
        await queue.put(_END)
