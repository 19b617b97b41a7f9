"""The scheduler alone: queues, caps, chunked prompts, the per-step token budget and the KV byte budget; no model,
no MLX."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest

from mlxd.engine.schedule.scheduler import Scheduler, SequenceState, prompts_to_batch


def seq(name: str, num_prompt: int, chunk: int = 8, max_tokens: int = 16, kv: int = 0) -> SequenceState:
    return SequenceState(request_id=name, num_prompt_tokens=num_prompt, prefill_chunk=chunk, max_tokens=max_tokens,
                         num_kv_bytes=kv)


def admitted(scheduler: Scheduler) -> list[str]:
    """Plan a step and return who runs (the plan's prompt chunks are not applied)."""
    scheduler.schedule()
    return [s.request_id for s in scheduler.running]


def run_prompt(scheduler: Scheduler, limit: int = 100) -> list[list[tuple[str, int]]]:
    """Schedule steps until no prompt is left, applying each plan; returns the prefill part of every plan."""
    plans = []
    for _ in range(limit):
        plan = scheduler.schedule()
        if not plan.prefill:
            return plans
        plans.append([(s.request_id, n) for s, n in plan.prefill])
        for sequence, num_tokens in plan.prefill:
            scheduler.on_prefilled(sequence, num_tokens)
    raise AssertionError("prompts never finished")


def test_scheduler_imports_no_mlx():
    code = "import sys, mlxd.engine.schedule.scheduler; sys.exit('mlx.core' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


@pytest.mark.parametrize(("num_prompt", "chunk"), [(1, 8), (8, 8), (9, 8), (37, 8), (100, 512)])
def test_a_prompt_takes_ceil_n_over_c_chunks(num_prompt, chunk):
    scheduler = Scheduler(max_running=4, max_waiting=4, step_token_budget=10_000)
    scheduler.add(seq("a", num_prompt, chunk))
    plans = run_prompt(scheduler)
    assert len(plans) == math.ceil(num_prompt / chunk)
    assert sum(n for plan in plans for _, n in plan) == num_prompt
    assert all(n == chunk for plan in plans[:-1] for _, n in plan)
    assert scheduler.running[0].phase == "decode"


def test_running_is_capped_and_the_rest_waits_in_order():
    scheduler = Scheduler(max_running=2, max_waiting=8, step_token_budget=1000)
    for name in "abcd":
        scheduler.add(seq(name, 4))
    plan = scheduler.schedule()
    assert [s.request_id for s, _ in plan.prefill] == ["a", "b"]
    assert [s.request_id for s in scheduler.waiting] == ["c", "d"]
    assert scheduler.num_running == 2
    scheduler.remove("a")
    plan = scheduler.schedule()
    # b's prompt was planned but not yet applied, so it is planned again; c takes a's slot.
    assert [s.request_id for s, _ in plan.prefill] == ["b", "c"]


def test_waiting_cap_counts_beyond_free_running_slots():
    scheduler = Scheduler(max_running=1, max_waiting=2, step_token_budget=100)
    for name in "abc":
        scheduler.add(seq(name, 4))
    assert not scheduler.can_add()
    with pytest.raises(OverflowError):
        scheduler.add(seq("d", 4))
    scheduler.schedule()  # admits a: still one running and two waiting
    assert not scheduler.can_add()
    scheduler.remove("a")
    assert scheduler.can_add() and not scheduler.can_add(num_pending=1)


def test_decode_rows_spend_the_budget_and_one_chunk_always_goes():
    scheduler = Scheduler(max_running=8, max_waiting=8, step_token_budget=20)
    for name in "abcde":
        scheduler.add(seq(name, 1, chunk=8))
    for sequence, num_tokens in scheduler.schedule().prefill:
        scheduler.on_prefilled(sequence, num_tokens)
    assert all(s.phase == "decode" for s in scheduler.running)
    scheduler.add(seq("long", 100, chunk=8))
    scheduler.add(seq("other", 100, chunk=8))
    plan = scheduler.schedule()
    # 5 decode tokens leave 15: one chunk of 8 fits, a second does not.
    assert len(plan.decode) == 5
    assert [(s.request_id, n) for s, n in plan.prefill] == [("long", 8)]
    assert plan.num_tokens == 13
    tight = Scheduler(max_running=8, max_waiting=8, step_token_budget=3)
    for name in "abcde":
        tight.add(seq(name, 1, chunk=8))
    run_prompt(tight)
    tight.add(seq("long", 100, chunk=8))
    plan = tight.schedule()
    assert len(plan.decode) == 5 and [n for _, n in plan.prefill] == [8]  # never starved


def test_a_long_prompt_interleaves_with_decode():
    scheduler = Scheduler(max_running=4, max_waiting=4, step_token_budget=9)
    scheduler.add(seq("a", 3, chunk=8))
    plan = scheduler.schedule()
    scheduler.on_prefilled(*plan.prefill[0])
    scheduler.add(seq("long", 40, chunk=8))
    for _ in range(5):
        plan = scheduler.schedule()
        assert [s.request_id for s in plan.decode][:1] == ["a"]
        assert [(s.request_id, n) for s, n in plan.prefill] == [("long", 8)]
        scheduler.on_prefilled(*plan.prefill[0])
    plan = scheduler.schedule()
    assert [s.request_id for s in plan.decode] == ["a", "long"] and not plan.prefill


def test_started_prompts_go_before_new_admissions():
    scheduler = Scheduler(max_running=4, max_waiting=4, step_token_budget=8)
    scheduler.add(seq("a", 16, chunk=8))
    scheduler.on_prefilled(*scheduler.schedule().prefill[0])
    scheduler.add(seq("b", 16, chunk=8))
    plan = scheduler.schedule()
    assert [s.request_id for s, _ in plan.prefill] == ["a"]
    assert [s.request_id for s in scheduler.waiting] == ["b"]


def test_remove_from_either_queue_and_snapshot():
    scheduler = Scheduler(max_running=1, max_waiting=4, step_token_budget=100)
    scheduler.add(seq("a", 4))
    scheduler.add(seq("b", 4))
    scheduler.schedule()
    assert scheduler.running[0].snapshot()["phase"] == "prefill"
    assert scheduler.waiting[0].snapshot()["phase"] == "waiting"
    assert scheduler.remove("b").request_id == "b"
    assert scheduler.remove("a").request_id == "a"
    assert scheduler.remove("a") is None
    assert not scheduler.has_work


def test_limits_must_be_positive():
    with pytest.raises(ValueError, match="at least 1"):
        Scheduler(max_running=0, max_waiting=1, step_token_budget=1)


def test_a_request_runs_only_when_its_kv_fits_and_waits_otherwise():
    scheduler = Scheduler(max_running=8, max_waiting=8, step_token_budget=1000, kv_budget_bytes=250)
    for name in "abc":
        scheduler.add(seq(name, 4, kv=100))
    assert admitted(scheduler) == ["a", "b"]  # a third row would make 300 bytes
    assert scheduler.num_reserved_bytes == 200
    assert [s.request_id for s in scheduler.waiting] == ["c"] and not scheduler.can_admit()


def test_a_release_lets_the_waiting_request_in():
    scheduler = Scheduler(max_running=8, max_waiting=8, step_token_budget=1000, kv_budget_bytes=250)
    for name in "abc":
        scheduler.add(seq(name, 4, kv=100))
    scheduler.schedule()
    scheduler.remove("a")
    assert scheduler.num_reserved_bytes == 100
    assert admitted(scheduler) == ["b", "c"]
    scheduler.remove("b")
    scheduler.remove("c")
    assert scheduler.num_reserved_bytes == 0 and not scheduler.has_work


def test_rows_are_counted_padded_to_the_largest_reservation():
    scheduler = Scheduler(max_running=8, max_waiting=8, step_token_budget=1000, kv_budget_bytes=300)
    scheduler.add(seq("a", 4, kv=100))
    scheduler.add(seq("b", 4, kv=150))
    scheduler.add(seq("small", 4, kv=10))
    # The decode batch pads every row to the longest: two rows of 150, and a third would make 450.
    assert admitted(scheduler) == ["a", "b"]
    assert scheduler.num_reserved_bytes == 300
    assert scheduler.num_reserved_bytes_with(scheduler.waiting[0]) == 450


def test_rows_of_a_padded_decode_batch_count_at_its_bucket_width():
    """Where the engine pads decode steps to buckets (1, 2, 4, 8, ...), the filler rows hold KV too: three requests
    of 100 bytes occupy four rows."""
    scheduler = Scheduler(max_running=8, max_waiting=8, step_token_budget=1000, kv_budget_bytes=350)
    scheduler.row_width = lambda n: 1 << (n - 1).bit_length()
    for name in "abc":
        scheduler.add(seq(name, 4, kv=100))
    assert admitted(scheduler) == ["a", "b"]  # a third row would occupy a bucket of 4: 400 bytes
    assert scheduler.num_reserved_bytes == 200
    assert scheduler.num_reserved_bytes_with(scheduler.waiting[0]) == 400


def test_a_burst_of_whole_prompts_starts_in_one_step_up_to_max_pass_tokens():
    """64 prompts of 256 tokens: 2 a step within a budget of 512; all 64, one group pass, when a pass may hold
    16384 tokens; as many as fit a smaller pass, in order; a decoding row keeps its token either way."""
    def burst(max_pass_tokens: int) -> tuple[list[str], list[list[str]]]:
        scheduler = Scheduler(max_running=65, max_waiting=64, step_token_budget=512)
        scheduler.max_pass_tokens = max_pass_tokens
        scheduler.add(seq("decoding", 4, chunk=512))
        scheduler.on_prefilled(scheduler.schedule().prefill[0][0], 4)
        for i in range(64):
            scheduler.add(seq(f"p{i}", 256, chunk=512))
        plan = scheduler.schedule()
        assert [s.request_id for s in plan.decode] == ["decoding"]
        return [s.request_id for s, _ in plan.prefill], [[s.request_id for s in g] for g in prompts_to_batch(
            plan.prefill)]

    started, groups = burst(0)
    assert started == ["p0"]  # the decoding row's token and one chunk of 256 leave 255: p1 waits
    started, groups = burst(16384)
    assert started == [f"p{i}" for i in range(64)] and groups == [started]
    started, _ = burst(1000)
    assert started == ["p0", "p1", "p2"]


def test_a_burst_does_not_stop_at_a_prompt_that_starts_from_a_cached_state():
    """16 prompts of 256 tokens, 4 of them (every fourth) starting from a cached state of 40 tokens (a prefix-cache
    hit): all 16 start in one step, the 12 whole prompts in one group pass and the 4 rests in another, where
    before the burst stopped at the first rest and the prompts behind it waited a whole pass. A rest still counts
    against max_pass_tokens."""
    def burst(max_pass_tokens: int) -> tuple[list[str], list[list[str]]]:
        scheduler = Scheduler(max_running=17, max_waiting=16, step_token_budget=512)
        scheduler.max_pass_tokens = max_pass_tokens
        for i in range(16):
            sequence = seq(f"p{i}", 256, chunk=512)
            if i % 4 == 2:
                sequence.num_prefilled = sequence.num_cached_tokens = 40
            scheduler.add(sequence)
        plan = scheduler.schedule()
        return [s.request_id for s, _ in plan.prefill], [[s.request_id for s in g] for g in prompts_to_batch(
            plan.prefill)]

    started, groups = burst(16384)
    rests = [f"p{i}" for i in (2, 6, 10, 14)]
    assert started == [f"p{i}" for i in range(16)]
    assert sorted(map(sorted, groups)) == sorted([sorted(set(started) - set(rests)), sorted(rests)])
    started, _ = burst(256 + 216 + 256)  # p0, p1 (whole, the first in the step's budget), p2's rest of 216
    assert started == ["p0", "p1", "p2"]


def test_a_burst_pass_and_the_reservations_fit_the_room_together():
    """With the pass's bytes measured (10 a token here) the burst stops where its padded pass and every
    reservation, its own rows' included, would exceed kv_budget_bytes: 32 prompts of 256 fit 85,220 bytes
    (81,920 for the pass, 3,300 for 33 rows of 100); a 33rd would not. Without the measure, all 64 start."""
    def burst(pass_bytes_per_token: int) -> list[str]:
        scheduler = Scheduler(max_running=65, max_waiting=64, step_token_budget=512, kv_budget_bytes=85_220)
        scheduler.max_pass_tokens = 32768
        scheduler.pass_bytes_per_token = pass_bytes_per_token
        scheduler.add(seq("decoding", 4, chunk=512, kv=100))
        scheduler.on_prefilled(scheduler.schedule().prefill[0][0], 4)
        for i in range(64):
            scheduler.add(seq(f"p{i}", 256, chunk=512, kv=100))
        plan = scheduler.schedule()
        assert [s.request_id for s in plan.decode] == ["decoding"]
        return [s.request_id for s, _ in plan.prefill]

    assert burst(10) == [f"p{i}" for i in range(32)]
    assert burst(0) == [f"p{i}" for i in range(64)]


def test_nothing_overtakes_a_head_that_does_not_fit():
    scheduler = Scheduler(max_running=8, max_waiting=8, step_token_budget=1000, kv_budget_bytes=300)
    scheduler.add(seq("a", 4, kv=100))
    assert admitted(scheduler) == ["a"]
    scheduler.add(seq("big", 4, kv=250))
    scheduler.add(seq("small", 4, kv=10))
    # small alone would fit beside a (2 x 100), but big is first in line: FIFO, so big is not starved.
    assert admitted(scheduler) == ["a"]
    assert [s.request_id for s in scheduler.waiting] == ["big", "small"]
    scheduler.remove("a")
    assert admitted(scheduler) == ["big"]  # small beside big would be 2 x 250
    scheduler.remove("big")
    assert admitted(scheduler) == ["small"]


def test_bytes_needed_include_the_head_only_when_it_could_be_admitted():
    scheduler = Scheduler(max_running=2, max_waiting=8, step_token_budget=1000, kv_budget_bytes=0)
    scheduler.add(seq("a", 4, kv=100))
    assert scheduler.num_bytes_needed(1000) == 100  # a is the head and fits a budget of 1000
    assert scheduler.num_bytes_needed(50) == 0  # it never fits 50: nothing to make room for
    scheduler.kv_budget_bytes = 1000
    scheduler.schedule()
    scheduler.add(seq("b", 4, kv=200))
    assert scheduler.num_bytes_needed(1000) == 400
    assert scheduler.num_bytes_needed(300) == 100  # b would make 400: the running request's 100 only
    scheduler.add(seq("c", 4, kv=1))
    scheduler.schedule()
    assert scheduler.num_running == 2
    assert scheduler.num_bytes_needed(10_000) == 400  # no free slot for c: its bytes are not needed yet


def test_no_kv_budget_means_no_byte_limit():
    scheduler = Scheduler(max_running=4, max_waiting=4, step_token_budget=1000)
    for name in "abcd":
        scheduler.add(seq(name, 4, kv=10**15))
    assert admitted(scheduler) == ["a", "b", "c", "d"]


def test_short_prompts_behind_a_long_one_that_does_not_fit_start_now():
    scheduler = Scheduler(max_running=8, max_waiting=8, step_token_budget=512)
    for name, size in [("image0", 323), ("text0", 57), ("image1", 323), ("text1", 57), ("text2", 57),
                       ("text3", 57)]:
        scheduler.add(seq(name, size, chunk=512))
    plans = run_prompt(scheduler)
    # 512 - 323 - 57 leaves 132: image1 waits, text1 and text2 (114) start in the first step; image1 goes
    # first in the next one.
    assert plans[0] == [("image0", 323), ("text0", 57), ("text1", 57), ("text2", 57)]
    assert plans[1] == [("image1", 323), ("text3", 57)]


def test_requests_whose_images_are_being_encoded_wait_without_holding_the_queue():
    scheduler = Scheduler(max_running=8, max_waiting=8, step_token_budget=512)
    image0, image1, text = seq("image0", 323, chunk=512), seq("image1", 323, chunk=512), seq("text", 57, chunk=512)
    for sequence in (image0, image1, text):
        sequence.encoding = sequence is not text
        scheduler.add(sequence)
    assert scheduler.head is text
    assert run_prompt(scheduler) == [[("text", 57)]]
    assert [s.request_id for s in scheduler.waiting] == ["image0", "image1"]
    scheduler.running.clear()
    assert not scheduler.has_work  # nothing to step: the engine waits for the encoder instead
    assert image1.snapshot()["phase"] == "encoding"
    image1.encoding = False
    assert scheduler.has_work and scheduler.head is image1
    assert run_prompt(scheduler) == [[("image1", 323)]]
    image0.encoding = False
    assert run_prompt(scheduler) == [[("image0", 323)]]


def test_only_whole_prompts_pass_and_the_head_keeps_a_slot():
    scheduler = Scheduler(max_running=3, max_waiting=8, step_token_budget=20)
    for name, size, chunk in [("a", 15, 16), ("head", 16, 16), ("long", 40, 4), ("b", 3, 8), ("c", 1, 8)]:
        scheduler.add(seq(name, size, chunk=chunk))
    plan = scheduler.schedule()
    # "long" would fit a chunk of 4 but not whole: it does not pass; "b" does; "c" would take the head's slot.
    assert [(s.request_id, n) for s, n in plan.prefill] == [("a", 15), ("b", 3)]
    assert [s.request_id for s in scheduler.waiting] == ["head", "long", "c"]


def test_nothing_passes_a_head_whose_kv_would_then_not_fit():
    scheduler = Scheduler(max_running=8, max_waiting=8, step_token_budget=20, kv_budget_bytes=400)
    for name, size, kv in [("a", 15, 100), ("head", 16, 100), ("big", 2, 200), ("small", 2, 100)]:
        scheduler.add(seq(name, size, chunk=16, kv=kv))
    plan = scheduler.schedule()
    # big beside a and head would reserve 4 x 200 > 400: it stops the search (in order), small is not reached.
    assert [s.request_id for s, _ in plan.prefill] == ["a"]
    assert [s.request_id for s in scheduler.waiting] == ["head", "big", "small"]


def test_prompts_share_a_pass_only_with_prompts_of_their_kind():
    """Whole text prompts, whole image prompts and rests after a cached start go in separate passes (a mixed group
    could run in none); rests of image prompts go alone; a kind with one prompt has no pass to share."""
    def state(name: str, size: int, *, done: int = 0, images: bool = False) -> tuple[SequenceState, int]:
        sequence = SequenceState(request_id=name, num_prompt_tokens=size, prefill_chunk=512, max_tokens=8,
                                 num_prefilled=done, route="vision" if images else "text")
        return sequence, size - done

    chunks = [state("t1", 40), state("i1", 300, images=True), state("t2", 50), state("r1", 90, done=60),
              state("i2", 320, images=True), state("r2", 80, done=40), state("ri", 400, done=300, images=True),
              state("lone-image-rest", 300, done=100, images=True)]
    groups = prompts_to_batch(chunks)
    assert [[s.request_id for s in group] for group in groups] == [["t1", "t2"], ["i1", "i2"], ["r1", "r2"]]
    assert prompts_to_batch([state("t1", 40), state("i1", 300, images=True), state("r1", 90, done=60)]) == []


def test_a_plan_made_elsewhere_starts_the_waiting_requests_it_names():
    """A follower (or a replay) runs rank 0's plan: the requests it names leave the queue for the running list, in
    the order named; one admitted already stays where it is."""
    scheduler = Scheduler(max_running=2, max_waiting=4, step_token_budget=64)
    x, y, z = seq("x", 8), seq("y", 8), seq("z", 8)
    for sequence in (x, y, z):
        scheduler.add(sequence)
    scheduler.start(y)
    scheduler.start(y)
    assert [s.request_id for s in scheduler.running] == ["y"] and y.phase == "prefill"
    assert [s.request_id for s in scheduler.waiting] == ["x", "z"] and x.phase == "waiting"


def test_a_snapshot_shows_the_rendered_prompt_only_when_asked():
    sequence = SequenceState(request_id="r", num_prompt_tokens=3, prefill_chunk=8, max_tokens=4,
                             prompt_text="secret " * 1000)
    assert "prompt" not in sequence.snapshot()
    shown = sequence.snapshot(prompt=True)["prompt"]
    assert shown.startswith("secret ") and len(shown) < 4200 and "characters]" in shown
