"""``detokenize``: token ids → text, with stop sequences cut exactly (:mod:`mlxd.pipeline.stops`, in linear time)
and special tokens kept out of content.

It makes :class:`ContentDelta`, :class:`TokenLogprobs` and :class:`Done` events: one of each for tokens that came
together (:class:`~mlxd.engine.base.Tokens`). Special tokens that a later stage
needs (``Job.keep_token_ids``: tool-call and channel markers, for ``parse``) stay in the text.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from mlxd.engine.base import Finished, Token, Tokens
from mlxd.pipeline.detokenizer import make_detokenizer
from mlxd.pipeline.events import ContentDelta, Done, TokenLogprob, TokenLogprobs, TopLogprob
from mlxd.pipeline.job import Job
from mlxd.pipeline.stage import NoOptions, PipelineContext, Stage
from mlxd.pipeline.stops import StopCutter


class DetokenizeConfig(NoOptions, frozen=True):
    # Special tokens (chat markers, BOS/EOS) never reach content unless this is turned off.
    skip_special_tokens: bool = True


class Detokenize(Stage):
    name = "detokenize"
    Config = DetokenizeConfig
    needs = frozenset({"prompt_ids", "stop"})

    def warm_up(self, ctx: PipelineContext) -> None:
        self.tokenizer = ctx.tokenizer
        self.detokenizers = make_detokenizer(ctx.tokenizer)
        self.skipped = ctx.model.special_token_ids if self.config.skip_special_tokens else frozenset()

    async def stream(self, job: Job, events: AsyncIterator[Any]) -> AsyncIterator[Any]:
        detokenizer = self.detokenizers()
        cutter = StopCutter(job.stop)
        skipped = self.skipped - job.keep_token_ids
        num_tokens = 0
        async with aclosing(events):
            async for event in events:
                kind = type(event)
                if kind is not Token and kind is not Tokens:
                    if not isinstance(event, Finished):
                        yield event
                        continue
                    text, stop = cutter.feed(detokenizer.finish())
                    text += "" if stop else cutter.flush()
                    if text:
                        yield ContentDelta(text)
                    yield _done(job, "stop" if stop else event.reason, num_tokens, event, stop_sequence=stop)
                    return
                tokens = (event,) if kind is Token else event.tokens
                entries, text, stop, used = self._feed(tokens, detokenizer, cutter, skipped)
                num_tokens += used
                if entries:
                    yield TokenLogprobs(tuple(entries))
                if text:
                    yield ContentDelta(text)
                if stop:
                    job.ended_by_pipeline = True
                    yield _done(job, "stop", num_tokens, stop_sequence=stop)
                    return

    def _feed(self, tokens: tuple[Token, ...], detokenizer: Any, cutter: StopCutter,
              skipped: frozenset[int]) -> tuple[list[TokenLogprob], str, str | None, int]:
        """Tokens that came together → their log-probabilities, their text (one delta), the stop sequence that
        matched (the tokens after it are not counted) and how many tokens count."""
        entries: list[TokenLogprob] = []
        texts: list[str] = []
        for used, token in enumerate(tokens, 1):
            if token.logprob is not None:
                entries.append(self._logprob(token))
            if token.token in skipped:
                continue
            text, stop = cutter.feed(detokenizer.add(token.token))
            if text:
                texts.append(text)
            if stop:
                return entries, "".join(texts), stop, used
        return entries, "".join(texts), None, len(tokens)

    def _logprob(self, token: Token) -> TokenLogprob:
        text = self.tokenizer.decode([token.token])
        top = tuple(TopLogprob(i, self.tokenizer.decode([i]), lp) for i, lp in token.top)
        return TokenLogprob(token=token.token, text=text, logprob=token.logprob, top=top)


def _done(job: Job, reason: str, num_tokens: int, finished: Finished | None = None,
          stop_sequence: str | None = None) -> Done:
    return Done(
        finish_reason=reason,
        num_prompt_tokens=len(job.prompt_ids),
        num_completion_tokens=num_tokens,
        num_cached_tokens=finished.num_cached_tokens if finished else 0,
        cache_hit=finished.cache_hit if finished else "miss",
        stop_sequence=stop_sequence,
        decode=finished.decode if finished else None,
        queued_s=finished.queued_s if finished else None,
        prefill_s=finished.prefill_s if finished else None,
    )
