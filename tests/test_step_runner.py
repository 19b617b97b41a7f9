"""The step runner on its own (mlxd/engine/step/runner.py): a scheduler's plan run over the tiny model gives each
request its solo greedy tokens, whole short prompts share a pass, and a request it cannot build fails alone."""

from __future__ import annotations

from typing import Any

from mlx_lm import load

from mlxd.config.schema import EngineConfig
from mlxd.engine.base import EngineRequest, Progress
from mlxd.engine.prefix import PromptReuse
from mlxd.engine.requests import RequestTable, Submitted
from mlxd.engine.schedule.scheduler import Scheduler, SequenceState, prompts_to_batch
from mlxd.engine.step.row import Refused, logits_width
from mlxd.engine.step.runner import StepRunner
from mlxd.engine.step.sampling import make_request_sampler
from tests.test_batched_engine import solo_tokens


class Listener:
    """Stands in for a RequestHandle: the runner only posts events to the table's outbox."""


def test_a_plan_runs_to_each_requests_solo_tokens_and_a_bad_request_fails_alone(tiny_model_dir):
    model, tokenizer = load(str(tiny_model_dir))
    config = EngineConfig(max_running=4, prefill_chunk=8, step_token_budget=64)
    table, scheduler = RequestTable(), Scheduler(max_running=4, max_waiting=4, step_token_budget=64)
    failed: list[tuple[str, str, Exception]] = []

    def fail(request_id: str, phase: str, error: Exception) -> None:
        failed.append((request_id, phase, error))
        runner.forget(request_id)
        scheduler.remove(request_id)
        table.pop(request_id)

    runner = StepRunner(model, config, table=table, scheduler=scheduler, reuse=PromptReuse(0), fail=fail,
                        make_sampler=make_request_sampler, drafter=None, share=None, trimmable=True, vision=None)
    runner.vocab_size = logits_width(model)
    prompts = {"short": tokenizer.encode("Hi there."), "also-short": tokenizer.encode("Two words."),
               "long": tokenizer.encode("A prompt long enough to take several chunks of eight tokens each. " * 2),
               "bad": [runner.vocab_size + 5]}
    for request_id, prompt in prompts.items():
        request = EngineRequest(request_id=request_id, prompt=prompt, max_tokens=6)
        submitted = Submitted(request, Listener(), SequenceState.for_request(request))  # type: ignore[arg-type]
        table.hold(submitted)
        scheduler.add(submitted.state)

    emitted: dict[str, list[int]] = {request_id: [] for request_id in prompts}
    num_grouped = 0
    for _ in range(40):
        plan = scheduler.schedule()
        groups = prompts_to_batch(plan.prefill)
        num_grouped += sum(len(group) for group in groups)
        runner.run_prompts([(table[s.request_id], n) for s, n in plan.prefill],
                           [[table[s.request_id] for s in group] for group in groups])
        tokens, waited_s = runner.decode()
        assert waited_s >= 0
        for request_id, row_tokens in zip(runner.batch.request_ids, tokens, strict=True):
            emitted[request_id] += row_tokens
        for request_id in [r for r in runner.batch.request_ids if len(emitted[r]) >= 6]:
            runner.forget(request_id)
            scheduler.remove(request_id)
        if not scheduler.has_work:
            break

    assert [(request_id, phase, type(error)) for request_id, phase, error in failed] == [("bad", "build", Refused)]
    for request_id in ("short", "also-short", "long"):
        assert emitted[request_id][:6] == solo_tokens(model, prompts[request_id], 6), request_id
    assert num_grouped == 3  # the whole short prompts were planned in one pass (the bad one failed building its row)
    progress: list[Any] = [event for _, event in table._outbox if isinstance(event, Progress)]
    assert progress[-1] == Progress(len(prompts["long"]), len(prompts["long"]))  # the last of its chunks
    assert not runner.prefilling and not len(runner.batch)
