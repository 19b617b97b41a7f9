"""``parse``: split generated text into content, reasoning and tool calls, and enforce the request's output format.

On the way in (``prepare``), it keeps the special tokens its parsers read out of ``detokenize``'s hands and, for
``tool_choice`` ``required`` or a named function and for ``response_format`` JSON, hands the engine a grammar as a
logits-processor factory (:mod:`mlxd.constraints`). On the way out (``stream``), content goes through the reasoning
parser, then the tool parser; a response with calls finishes as ``tool_calls``. A call the configured tool parser
does not read but another known format does (Hermes JSON in Qwen3-Coder output, a bare JSON call) is recovered
(:mod:`mlxd.pipeline.parsers.tools.fallback`). A named ``tool_choice`` or ``parallel_tool_calls: false`` keeps the
first call only. Text completions pass through.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

import msgspec

from mlxd.constraints import GrammarCompiler, make_constraint_factory
from mlxd.errors import RequestError
from mlxd.pipeline.events import ContentDelta, Done, ToolCallDelta
from mlxd.pipeline.job import Job
from mlxd.pipeline.parsers.harmony import HarmonyParser
from mlxd.pipeline.parsers.registry import reasoning_parser_for, tool_parser_for
from mlxd.pipeline.parsers.tools.fallback import FallbackToolParser
from mlxd.pipeline.parsers.tools.generic import GenericToolParser
from mlxd.pipeline.stage import NoOptions, PipelineContext, Stage


class ParseConfig(NoOptions, frozen=True):
    # "auto": the format the chat template uses; a registry name (hermes, qwen3_coder, seed_oss, llama3, mistral,
    # deepseek, glm45, pythonic, harmony, generic); or "none".
    tool_parser: str = "auto"
    # "auto": the chat template's (think, seed_oss, harmony); a registry name; or "none".
    reasoning_parser: str = "auto"


class Parse(Stage):
    name = "parse"
    Config = ParseConfig
    # It adds its grammar to the engine request ``decode`` built.
    needs = frozenset({"prompt_text", "tools", "tool_choice", "response_format", "engine_request"})
    provides = frozenset({"keep_token_ids"})

    def __init__(self, config: ParseConfig) -> None:
        super().__init__(config)
        # Unknown names are config errors at start-up, before the model loads.
        for name, lookup in ((config.tool_parser, tool_parser_for), (config.reasoning_parser, reasoning_parser_for)):
            if name != "auto":
                lookup(name, None)

    def warm_up(self, ctx: PipelineContext) -> None:
        template = getattr(ctx.tokenizer, "chat_template", None)
        self.tool_cls = tool_parser_for(self.config.tool_parser, template)
        self.reasoning_cls = reasoning_parser_for(self.config.reasoning_parser, template)
        if self.tool_cls is HarmonyParser:  # one parser reads all of Harmony's channels
            self.reasoning_cls = None
        markers = [m for cls in (self.tool_cls, self.reasoning_cls) if cls for m in cls.special_markers]
        self.keep_token_ids = frozenset(_special_ids(ctx.tokenizer, markers) & ctx.model.special_token_ids)
        self.compiler = GrammarCompiler(ctx.tokenizer, n_vocab=ctx.model.vocab_size)
        self.eos_token_ids = sorted(ctx.model.eos_token_ids)

    def prepare(self, job: Job) -> None:
        if job.messages is None:
            return
        job.keep_token_ids = job.keep_token_ids | self.keep_token_ids
        grammar = self._grammar(job)
        if grammar is not None and job.engine_request is not None:
            job.engine_request.logits_processors = make_constraint_factory(grammar, self.compiler, self.eos_token_ids)

    def _grammar(self, job: Job) -> Any:
        forced = job.forced_output()
        if forced is None:
            return None
        if self.reasoning_cls is not None and self.reasoning_cls.opens_in_prompt(job.prompt_text):
            raise RequestError("constrained output cannot start inside the open reasoning block this prompt ends "
                               "with; turn thinking off (reasoning_effort 'none' or chat_template_kwargs "
                               "{\"enable_thinking\": false})", param=forced)
        if forced == "tool_choice":
            if self.tool_cls is None or self.tool_cls.name != "hermes":
                name = self.tool_cls.name if self.tool_cls else "none"
                raise RequestError(f"tool_choice {job.tool_choice!r} is enforced for Hermes-format tool calls only; "
                                   f"this model's tool format is {name!r}", param="tool_choice")
            # A named function is one call of it, whatever parallel_tool_calls says.
            parallel = job.parallel_tool_calls and job.tool_choice == "required"
            return self.compiler.tool_call(job.tools, job.tool_choice, parallel)
        fmt = job.response_format
        if fmt["type"] == "json_object":
            return self.compiler.json_object()
        return self.compiler.json_schema(fmt["schema"], fmt["strict"])

    def stream(self, job: Job, events: AsyncIterator[Any]) -> AsyncIterator[Any]:
        """Text completions, and chats with neither a reasoning parser nor tools, pass through untouched (no
        extra step per token)."""
        reasoning, tools = (self._reasoning(job), self._tools(job)) if job.messages is not None else (None, None)
        if reasoning is None and tools is None:
            return events
        return _Splitter(reasoning, tools, self._recovery(job, tools), single_call=_single_call(job)).run(events)

    def _reasoning(self, job: Job) -> Any:
        cls = self.reasoning_cls
        return cls(in_reasoning=cls.opens_in_prompt(job.prompt_text)) if cls is not None else None

    def _tools(self, job: Job) -> Any:
        if self.tool_cls is None or not (job.tools or self.tool_cls is HarmonyParser):
            return None
        return self.tool_cls(job.tools)

    def _recovery(self, job: Job, parser: Any) -> FallbackToolParser | None:
        """Calls in another known format are recovered, unless the content is meant to be JSON (response_format)."""
        if parser is None or not job.tools or job.response_format is not None:
            return None
        return None if self.tool_cls in (HarmonyParser, GenericToolParser) else FallbackToolParser(parser, job.tools)


def _single_call(job: Job) -> bool:
    """Whether the response may hold one call only: a named ``tool_choice``, or ``parallel_tool_calls`` false."""
    return bool(job.tools) and (isinstance(job.tool_choice, dict) or not job.parallel_tool_calls)


class _Splitter:
    """Content through the reasoning parser, then what stays content through the tool parser (``tools``, the
    model's format) and, with ``recovery``, the calls in other formats in what that parser leaves as content. With
    ``single_call``, calls after the first are dropped (their markup never reaches content either)."""

    def __init__(self, reasoning: Any, tools: Any, recovery: FallbackToolParser | None = None,
                 single_call: bool = False) -> None:
        self.reasoning, self.tools, self.recovery, self.single_call = reasoning, tools, recovery, single_call

    async def run(self, events: AsyncIterator[Any]) -> AsyncIterator[Any]:
        """``events`` with their content split: the reasoning parser's pieces first, then what stays content
        through the tool parser (its ``feed`` turns call markup into :class:`ToolCallDelta` events)."""
        async with aclosing(events):
            async for event in events:
                if isinstance(event, ContentDelta):
                    pieces = self.reasoning.feed(event.text) if self.reasoning else [event]
                elif isinstance(event, Done):  # what the parsers still hold, then the final event
                    pieces = self.reasoning.finish() if self.reasoning else []
                else:
                    yield event
                    continue
                for piece in pieces:
                    if self.tools is not None and isinstance(piece, ContentDelta):
                        for out in self._calls(self.tools.feed(piece.text)):  # the tool-call parse
                            yield out
                    elif not isinstance(piece, ContentDelta) or piece.text:
                        yield piece
                if isinstance(event, Done):
                    for out in self._rest():
                        yield out
                    yield self.done(event)
                    return

    def done(self, done: Done) -> Done:
        counter = self.recovery if self.recovery is not None else self.tools
        if counter is not None and counter.num_calls and done.finish_reason == "stop":
            return msgspec.structs.replace(done, finish_reason="tool_calls")
        return done

    def _rest(self) -> list[Any]:
        """What the tool parser (and the recovery) still hold at the end of the stream."""
        if self.recovery is not None:
            return self._allowed(self.recovery.finish())  # the tool parser's rest, routed, then the fallback's
        return self._allowed(self.tools.finish() if self.tools is not None else [])

    def _calls(self, events: list[Any]) -> list[Any]:
        """The tool parser's events, through the recovery of other formats, less the calls not allowed."""
        return self._allowed(self.recovery.route(events) if self.recovery is not None else events)

    def _allowed(self, events: list[Any]) -> list[Any]:
        if not self.single_call:
            return events
        return [e for e in events if not isinstance(e, ToolCallDelta) or e.index == 0]


def _special_ids(tokenizer: Any, markers: list[str]) -> set[int]:
    ids = set()
    for marker in markers:
        token_id = tokenizer.convert_tokens_to_ids(marker)
        if isinstance(token_id, int) and token_id != getattr(tokenizer, "unk_token_id", None):
            ids.add(token_id)
    return ids
