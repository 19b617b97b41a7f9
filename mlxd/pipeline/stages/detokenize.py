"""``detokenize``: token ids → text, with stop sequences cut exactly and special tokens kept out of content."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from mlxd.engine.base import Finished, Token
from mlxd.pipeline.job import Done, Job, TextDelta
from mlxd.pipeline.stage import NoOptions, PipelineContext, Stage


class DetokenizeConfig(NoOptions, frozen=True):
    # Special tokens (chat markers, BOS/EOS) never reach content unless this is turned off.
    skip_special_tokens: bool = True


class StopCutter:
    """Finds stop sequences across token boundaries, holding back text that may start one."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = [s for s in stops if s]
        self.text = ""
        self.emitted = 0

    def feed(self, segment: str) -> tuple[str, bool]:
        """Add text; return (text safe to emit now, whether a stop sequence was hit)."""
        start = max(0, self.emitted - max((len(s) for s in self.stops), default=0))
        self.text += segment
        hits = [i for i in (self.text.find(s, start) for s in self.stops) if i >= 0]
        if hits:
            return self._emit_until(min(hits)), True
        return self._emit_until(len(self.text) - self._held_back()), False

    def flush(self) -> str:
        return self._emit_until(len(self.text))

    def _held_back(self) -> int:
        longest = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(self.text)), longest, -1):
                if self.text.endswith(stop[:n]):
                    longest = n
                    break
        return longest

    def _emit_until(self, end: int) -> str:
        end = max(end, self.emitted)
        out, self.emitted = self.text[self.emitted : end], end
        return out


class Detokenize(Stage):
    name = "detokenize"
    Config = DetokenizeConfig

    def warm_up(self, ctx: PipelineContext) -> None:
        self.tokenizer = ctx.tokenizer
        self.skipped = ctx.model.special_token_ids if self.config.skip_special_tokens else frozenset()

    async def stream(self, job: Job, events: AsyncIterator[Any]) -> AsyncIterator[Any]:
        detokenizer = self.tokenizer.detokenizer
        cutter = StopCutter(job.stop)
        num_tokens = 0
        async with aclosing(events):
            async for event in events:
                if not isinstance(event, Token | Finished):
                    yield event
                    continue
                if isinstance(event, Finished):
                    detokenizer.finalize()
                    text, stopped = cutter.feed(detokenizer.last_segment)
                    text += "" if stopped else cutter.flush()
                    if text:
                        yield TextDelta(text)
                    yield _done(job, "stop" if stopped else event.reason, num_tokens, event)
                    return
                num_tokens += 1
                if event.token in self.skipped:
                    continue
                detokenizer.add_token(event.token)
                text, stopped = cutter.feed(detokenizer.last_segment)
                if text:
                    yield TextDelta(text)
                if stopped:
                    yield _done(job, "stop", num_tokens)
                    return


def _done(job: Job, reason: str, num_tokens: int, finished: Finished | None = None) -> Done:
    return Done(
        finish_reason=reason,
        num_prompt_tokens=len(job.prompt_ids),
        num_completion_tokens=num_tokens,
        num_cached_tokens=finished.num_cached_tokens if finished else 0,
        cache_hit=finished.cache_hit if finished else "miss",
    )
