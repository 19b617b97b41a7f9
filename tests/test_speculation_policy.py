"""The speculative row's policy, without a model: draft length, back-off when drafting does not pay (against the
measured cost of a verify step, or the acceptance rate before costs are known), and the step token budget."""

from __future__ import annotations

from mlxd.engine.base import Speculative
from mlxd.engine.speculative.state import SpecState
from mlxd.engine.step.stepcosts import StepCosts


class Named:
    name = "test"


def state(k: int = 4, adaptive: bool = True, max_tokens: int = 1000) -> SpecState:
    return SpecState.for_request(Speculative(drafter="test", k=k, adaptive=adaptive), Named(), [1, 2, 3], max_tokens,
                                 min_acceptance=0.3, max_step_tokens=64)


def costs(plain_s: float, verify_s: float, width: int = 5, batch_size: int = 1) -> StepCosts:
    measured = StepCosts()
    measured.record(batch_size, 1, plain_s)
    measured.record(batch_size, width, verify_s)
    return measured


def test_a_verify_step_dearer_than_what_the_drafts_gain_pauses_the_row():
    row = state()
    for _ in range(2):
        row.record(drafted=4, accepted=4, emitted=5)  # every draft kept: 5 tokens a step
    expensive = costs(plain_s=0.010, verify_s=0.065)  # 6.5 plain steps a verify step (seen on one GPU backend)
    assert row.draft_length(1, expensive) == 0
    assert row.reason == "a verify step costs 6.50 plain steps; drafts gain 5.00" and row.pause == 8
    assert [row.draft_length(1, expensive) for _ in range(8)] == [0] * 8 and row.pause == 0


def test_modest_acceptance_keeps_drafting_when_verification_is_cheap():
    row = state()
    for _ in range(4):
        row.record(drafted=4, accepted=2, emitted=3)
    assert 0.4 < row.acceptance < 0.7 and row.k == 1  # not every draft kept: the draft shrank
    # Verifying one draft at 1.13 plain steps (cheap: a memory-bound forward pass), gaining ~1.5 tokens a step.
    assert row.draft_length(1, costs(plain_s=0.084, verify_s=0.095, width=2)) == 1


def test_before_costs_are_known_a_low_acceptance_rate_pauses_the_row():
    row = state()
    for _ in range(4):
        row.record(drafted=row.k, accepted=0, emitted=1)
    assert row.draft_length(1, StepCosts()) == 0 and row.reason.startswith("acceptance")


def test_a_drafter_with_nothing_to_propose_pauses_the_row_after_four_steps():
    row = state()
    for _ in range(3):
        row.record_empty()
    assert row.pause == 0
    row.record_empty()
    assert row.pause == 8 and "nothing to propose 4 steps in a row" in row.reason


def test_fixed_k_never_backs_off_and_drafts_fit_the_step_and_max_tokens():
    row = state(adaptive=False, max_tokens=3)
    for _ in range(5):
        row.record(drafted=2, accepted=0, emitted=1) if row.remaining > 1 else None
    assert row.backoffs == 0
    assert state(adaptive=False).draft_length(16, costs(0.01, 1.0)) == 3  # 64 positions / 16 rows = 1 + 3 drafts
    assert state(adaptive=False).draft_length(64, None) == 0  # a full batch: no room for drafts
    assert state(adaptive=False, max_tokens=2).draft_length(1) == 1  # never past max_tokens


def test_a_batch_speculates_only_when_its_rows_together_gain_more_than_every_row_pays():
    """Four rows at a width of 5 cost 1.8 plain steps each: one row whose drafts all land (5 tokens) and three
    plain rows (1 token each) make 8 tokens where 4 x 1.8 = 7.2 are paid; at half acceptance, 4.94 do not."""
    from types import SimpleNamespace

    from mlxd.engine.speculative.step import batch_pays

    def batch(acceptance: float):
        drafting = state()
        drafting.acceptance = acceptance
        rows = [SimpleNamespace(spec=drafting)] + [SimpleNamespace(spec=None) for _ in range(3)]
        return rows, costs(plain_s=0.010, verify_s=0.018, width=5, batch_size=4)

    assert batch_pays(*batch(1.0), [4, 0, 0, 0])
    losing = batch(0.5)
    assert not batch_pays(*losing, [4, 0, 0, 0])
    assert losing[0][0].spec.reason == "the batch's drafts gain 1.23 tokens a row; a verify step costs 1.80 plain steps"
    assert batch_pays(losing[0], StepCosts(), [4, 0, 0, 0])  # unknown: measure it
    fixed = batch(0.5)
    fixed[0][0].spec.adaptive = False
    assert batch_pays(*fixed, [4, 0, 0, 0])  # a row drafting a fixed k (adaptive off) always drafts


def test_greedy_verification_picks_what_plain_decoding_picks_on_near_tied_bfloat16_logits():
    """A random bf16 model's logits are nearly tied: their log-probabilities round to equal values, and plain
    decoding (mlx-lm's greedy sampler over ``logits - logsumexp``) takes the first of the tied ones, which is not
    the raw argmax. Verification must pick the same token, or a greedy speculative row drifts from plain decoding
    (on an H100 with a Qwen3-8B-shaped random model, every draft was rejected)."""
    import mlx.core as mx

    from mlxd.engine.base import SamplingParams
    from mlxd.engine.speculative.state import verify
    from mlxd.engine.step.sampling import make_request_sampler

    logits = (0.02 * mx.random.normal((6, 151936), key=mx.random.key(3))).astype(mx.bfloat16)
    plain = make_request_sampler(SamplingParams(temperature=0.0))
    expected = [int(plain(logits[i : i + 1] - mx.logsumexp(logits[i : i + 1], keepdims=True)).item())
                for i in range(6)]
    assert expected != mx.argmax(logits, axis=-1).tolist()  # the trap is there: raw argmax differs
    accepted, candidates = verify(SamplingParams(temperature=0.0), logits, expected[:5], None)
    assert candidates.tolist() == expected
    assert accepted.tolist() == [True] * 5
