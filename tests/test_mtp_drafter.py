"""The MTP drafter on the tiny Qwen3.5 + MTP checkpoint: its drafts are mlx-vlm's own drafter's, it reads the
right hidden state, batching does not change them, and speculative greedy decoding equals plain greedy decoding
(one row, two rows with ragged acceptance)."""

from __future__ import annotations

import filecmp
import time
from pathlib import Path

import pytest

from mlxd.engine.drafters.base import DraftRow

mx = pytest.importorskip("mlx.core")
mlx_vlm = pytest.importorskip("mlx_vlm")

from mlxd.engine.drafters.mtp import MTPDrafter, make_mtp_drafter  # noqa: E402
from mlxd.models.vlm import VisionLanguageModel  # noqa: E402
from tests.support.tiny_hybrid import build_tiny_qwen3_5_mtp, tiny_qwen3_5_mtp_cached  # noqa: E402

PROMPTS = ["The quick brown fox jumps over the lazy dog. A journey", "Hello, world! How are"]
NUM_TOKENS = 24


@pytest.fixture(scope="session")
def mtp_folder(tiny_models_root: Path) -> Path:
    return tiny_qwen3_5_mtp_cached(tiny_models_root)


@pytest.fixture
def target(mtp_folder: Path) -> tuple[VisionLanguageModel, list[list[int]]]:
    """A fresh copy of the target (tests change its weights) and the prompts' token ids."""
    model, processor = mlx_vlm.load(str(mtp_folder))
    return VisionLanguageModel(model), [processor.tokenizer.encode(p) for p in PROMPTS]


def _deltas(batch: int) -> mx.array:
    return mx.zeros((batch, 1), dtype=mx.int32)


def _prefill(vm: VisionLanguageModel, ids: list[int]) -> tuple[list, int, mx.array]:
    cache = vm.make_cache()
    logits, hidden = vm.forward_hidden(mx.array([ids]), cache)
    return cache, int(mx.argmax(logits[0, -1]).item()), hidden[0]


def _plain(vm: VisionLanguageModel, ids: list[int], n: int = NUM_TOKENS) -> list[int]:
    cache, token, _ = _prefill(vm, ids)
    out = [token]
    while len(out) < n:
        logits, _ = vm.forward_hidden(mx.array([[out[-1]]]), cache, rope_deltas=_deltas(1))
        out.append(int(mx.argmax(logits[0, -1]).item()))
    return out


def _speculative(vm, drafter, prompts, k, *, exact="all", spoil=None, n=NUM_TOKENS):
    """Greedy speculative decoding; rows are prefilled alone and their caches merged per layer (mlx-lm's way).
    ``exact``: give the drafter the hidden states of every newly kept position ("all") or of the last ("last")."""
    rows = [_prefill(vm, ids) for ids in prompts]
    cache = [type(layer[0]).merge(list(layer)) for layer in zip(*(r[0] for r in rows), strict=True)]
    gen = [[token] for _, token, _ in rows]
    hidden = [h if exact == "all" else h[-1:] for _, _, h in rows]
    accept_lens = []
    while min(len(g) for g in gen) < n:
        rows = zip(prompts, gen, hidden, strict=True)
        drafts = drafter.propose([DraftRow(f"r{i}", p + g, k, h) for i, (p, g, h) in enumerate(rows)])
        if spoil:
            drafts = spoil(len(accept_lens), drafts)
        width = 1 + max(len(d) for d in drafts)
        inputs = mx.array([[g[-1], *d] + [0] * (width - 1 - len(d)) for g, d in zip(gen, drafts, strict=True)])
        logits, verify_hidden, transaction = vm.verify_forward(inputs, cache, rope_deltas=_deltas(len(gen)))
        verdict = mx.argmax(logits, axis=-1).tolist()
        accepted = []
        for i, d in enumerate(drafts):
            a = next((j for j, t in enumerate(d) if t != verdict[i][j]), len(d))
            gen[i] += d[:a] + [verdict[i][a]]
            drafter.commit(f"r{i}", a)
            hidden[i] = verify_hidden[i, : a + 1] if exact == "all" else verify_hidden[i, a : a + 1]
            accepted.append(a)
        transaction.commit([1 + a for a in accepted])
        accept_lens.append(accepted)
    for i in range(len(prompts)):
        drafter.release(f"r{i}")
    return [g[:n] for g in gen], accept_lens


def _zero_branches(layers) -> None:
    for layer in layers:
        mixer = layer.linear_attn.out_proj if getattr(layer, "is_linear", False) else layer.self_attn.o_proj
        mixer.weight = mx.zeros_like(mixer.weight)
        layer.mlp.down_proj.weight = mx.zeros_like(layer.mlp.down_proj.weight)


def _head(folder: Path):
    from mlx_vlm.speculative.drafters import load_drafter

    return load_drafter(str(folder), kind="mtp")[0]


def _pass_through(head, *, hidden: bool):
    """Make the head return (a multiple of) its hidden input (``hidden``) or its token's normed embedding."""
    size = head.fc.weight.shape[0]
    halves = [mx.zeros((size, size)), mx.eye(size)]
    head.fc.weight = mx.concatenate(halves if hidden else halves[::-1], axis=1)
    _zero_branches(head.layers)
    return head


def test_mlx_vlm_has_the_public_pieces_mtp_uses(target, mtp_folder):
    """The public pieces; the private helpers (and mlx-vlm's version bound) are in tests/test_upstream_privates.py."""
    from mlx_vlm.models.cache import BatchKVCache
    from mlx_vlm.speculative.cache_state import SpeculativeCacheTransaction
    from mlx_vlm.speculative.drafters.qwen3_5_mtp import Qwen3_5MTPDraftModel

    for name in ("bind", "make_cache"):
        assert callable(getattr(Qwen3_5MTPDraftModel, name, None)), f"Qwen3_5MTPDraftModel.{name} is gone"
    for name in ("merge", "prepare", "finalize", "extract", "trim"):
        assert callable(getattr(BatchKVCache, name, None)), f"BatchKVCache.{name} is gone"
    vm, _ = target
    assert isinstance(_head(mtp_folder).bind(vm), Qwen3_5MTPDraftModel)
    *_, transaction = vm.verify_forward(mx.array([[1, 2]]), vm.make_cache())
    assert isinstance(transaction, SpeculativeCacheTransaction)


def test_checkpoint_is_a_hybrid_target_with_an_mtp_head(mtp_folder, tmp_path):
    from mlx.utils import tree_flatten
    from mlx_vlm.speculative.drafters import load_drafter

    started = time.perf_counter()
    build_tiny_qwen3_5_mtp(tmp_path)
    assert time.perf_counter() - started < 10
    assert filecmp.cmp(tmp_path / "model.safetensors", mtp_folder / "model.safetensors", shallow=False)
    model, _ = mlx_vlm.load(str(mtp_folder))
    assert not any(name.startswith("mtp.") for name, _ in tree_flatten(model.parameters()))
    assert [type(c).__name__ for c in model.language_model.make_cache()] == ["ArraysCache", "KVCache"] * 2
    head, kind = load_drafter(str(mtp_folder), kind="mtp")
    assert (type(head).__name__, kind, len(head.layers)) == ("Qwen3_5MTPDraftModel", "mtp", 1)


def test_make_mtp_drafter_reads_native_and_split_checkpoints(target, mtp_folder, tmp_path):
    import shutil

    from mlx_vlm.split_mtp import split_mtp

    from mlxd.errors import ConfigError

    vm, prompts = target
    split = split_mtp(str(mtp_folder), str(tmp_path / "split"))
    row = DraftRow("r", prompts[1] + [7], 3, mx.random.normal((4, 64), key=mx.random.key(0)))
    assert make_mtp_drafter(vm, split).propose([row]) == make_mtp_drafter(vm, mtp_folder).propose([row])
    bare = shutil.copytree(mtp_folder, tmp_path / "bare")
    weights = {k: v for k, v in mx.load(str(bare / "model.safetensors")).items() if not k.startswith("mtp.")}
    mx.save_safetensors(str(bare / "model.safetensors"), weights, metadata={"format": "mlx"})
    with pytest.raises(ConfigError, match="No MTP tensors"):
        make_mtp_drafter(vm, bare)
    with pytest.raises(ConfigError, match="needs a Qwen3.5-family model"):
        make_mtp_drafter(object(), mtp_folder)


def test_forward_with_hidden_gives_the_post_norm_hidden_state(target):
    vm, prompts = target
    inputs = mx.array([prompts[0]])
    logits, hidden = vm.forward_hidden(inputs, vm.make_cache())
    assert hidden.shape == (1, len(prompts[0]), 64) and logits.shape[:2] == hidden.shape[:2]
    assert mx.allclose(vm.language_model.lm_head(hidden), logits, atol=1e-4)
    assert mx.allclose(vm(inputs, cache=vm.make_cache(), rope_deltas=_deltas(1)), logits, atol=1e-4)
    verify_logits, verify_hidden, _ = vm.verify_forward(inputs, vm.make_cache())
    assert mx.allclose(verify_logits, logits, atol=1e-3) and mx.allclose(verify_hidden, hidden, atol=1e-3)


def test_drafts_are_mlx_vlms_own_drafters(target, mtp_folder):
    """Step for step against Qwen3_5MTPDraftModel's own prefill / draft_block / accept_verified_tokens, keeping
    drafts whatever the target says (so that every acceptance count occurs)."""
    vm, prompts = target
    ours = make_mtp_drafter(vm, mtp_folder)
    theirs = _head(mtp_folder)
    theirs.reset(vm)
    k = 3
    cache, token, hidden = _prefill(vm, prompts[0])
    seq = prompts[0] + [token]
    theirs.prefill_from_target_hidden(mx.array([prompts[0]]), hidden[None], token, None, greedy=True)
    exact = hidden  # the whole prompt's, as mlx-vlm's prefill has them
    for accepted in (0, 2, 3, 1, 3, 0, 2):
        mine = ours.propose([DraftRow("r", seq, k, exact)])[0]
        reference = theirs.draft_block(mx.array([seq[-1]]), exact[None, -1:], None, k + 1, None, greedy=True)
        assert mine == reference[0].tolist()
        logits, verify_hidden, transaction = vm.verify_forward(mx.array([[seq[-1], *mine]]), cache)
        bonus = int(mx.argmax(logits[0, accepted]).item())
        transaction.commit([accepted + 1])
        theirs.accept_verified_tokens(verify_hidden, mx.array([mine]), accepted, mine[:accepted] + [bonus], None,
                                      greedy=True)
        ours.commit("r", accepted)
        seq += mine[:accepted] + [bonus]
        # mlx-vlm replays the target's hidden state from its last draft forward on (k - 1 of them per block).
        exact = verify_hidden[0, min(accepted, k - 1) : accepted + 1]


@pytest.mark.parametrize("whole_prompt", [False, True])
def test_first_draft_of_a_head_that_echoes_its_hidden_is_the_last_token(target, mtp_folder, whole_prompt):
    """A head that returns its hidden input predicts what the target predicts from that hidden state: the row's
    last token, for each row of a batch, iff ``hidden`` is the target's post-norm state before that token."""
    vm, prompts = target
    drafter = MTPDrafter(_pass_through(_head(mtp_folder), hidden=True), vm)
    rows = [_prefill(vm, ids) for ids in prompts]
    requests = [DraftRow(f"r{i}", ids + [token], 2, h if whole_prompt else h[-1:])
                for i, (ids, (_, token, h)) in enumerate(zip(prompts, rows, strict=True))]
    assert [d[0] for d in drafter.propose(requests)] == [token for _, token, _ in rows]


def test_a_batch_drafts_what_its_rows_draft_alone(target, mtp_folder):
    vm, prompts = target
    rows = [_prefill(vm, ids) for ids in prompts]
    requests = [DraftRow("a", prompts[0] + [rows[0][1]], 3, rows[0][2]),  # the whole prompt: a wide first feed
                DraftRow("b", prompts[1] + [rows[1][1]], 2, rows[1][2][-1:])]
    alone = [make_mtp_drafter(vm, mtp_folder).propose([r])[0] for r in requests]
    together = make_mtp_drafter(vm, mtp_folder).propose(requests)
    assert together == alone and [len(d) for d in together] == [3, 2]


@pytest.mark.parametrize(("num_rows", "k", "exact"), [(1, 3, "last"), (2, 2, "all"), (2, 3, "last")])
def test_speculative_decoding_equals_plain_decoding(target, mtp_folder, num_rows, k, exact):
    vm, prompts = target
    plain = [_plain(vm, ids) for ids in prompts[:num_rows]]
    got, _ = _speculative(vm, make_mtp_drafter(vm, mtp_folder), prompts[:num_rows], k, exact=exact)
    assert got == plain


def test_ragged_acceptance_with_a_head_that_always_agrees(target, mtp_folder):
    """With every residual branch of the target zeroed its next token depends on the current one only, and a head
    that passes its token's embedding through computes the same: all its drafts are accepted. Row 1's drafts are
    spoiled from a varying position on, so the rows of a step accept different numbers of tokens."""
    vm, prompts = target
    _zero_branches(vm.language_model.model.layers)
    head = _pass_through(_head(mtp_folder), hidden=False)
    head.norm.weight = vm.language_model.model.norm.weight
    drafter = MTPDrafter(head, vm)

    def spoil(step, drafts):
        cut = step % 4
        return [drafts[0], drafts[1][:cut] + [(t + 1) % 7 for t in drafts[1][cut:]]]

    plain = [_plain(vm, ids, 32) for ids in prompts]
    got, accept_lens = _speculative(vm, drafter, prompts, 3, exact="last", spoil=spoil, n=32)
    assert got == plain
    assert all(a == 3 for a, _ in accept_lens) and {b for _, b in accept_lens} == {0, 1, 2, 3}


def test_commit_release_and_bad_rows(target, mtp_folder):
    vm, prompts = target
    drafter = make_mtp_drafter(vm, mtp_folder)
    _, token, hidden = _prefill(vm, prompts[1])
    assert drafter.propose([DraftRow("a", [token], 2, hidden[-1:])]) == [[]]  # nothing run by the target yet
    assert len(drafter.propose([DraftRow("a", prompts[1] + [token], 2, hidden[-1])])[0]) == 2
    with pytest.raises(ValueError, match="3 accepted of 2"):
        drafter.commit("a", 3)
    drafter.commit("a", 2)
    drafter.release("a")
    assert "a" not in drafter._rows
    with pytest.raises(ValueError, match="needs the target's hidden state"):
        drafter.propose([DraftRow("b", prompts[1] + [token], 2)])
    with pytest.raises(ValueError, match="hidden must be"):
        drafter.propose([DraftRow("b", prompts[1] + [token], 2, hidden[-1:, :8])])
