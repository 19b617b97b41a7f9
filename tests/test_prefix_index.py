"""The prefix index on its own: match kinds, the one-token rule, dominance, LRU and pins, against a brute force."""

from __future__ import annotations

import random
import subprocess
import sys

import pytest

from mlxd.cache.index import Match, PrefixIndex

P = list(range(100, 110))  # a 10-token prompt


def test_prefix_entry_is_used_as_is():
    index = PrefixIndex()
    e = index.add(P[:6], trimmable=False)
    assert index.match(P) == Match(e, 6, 0, "prefix")


def test_exact_entry_is_trimmed_by_one_token_when_trimmable():
    index = PrefixIndex()
    e = index.add(P, trimmable=True)
    assert index.match(P) == Match(e, 9, 1, "exact")


def test_exact_entry_that_cannot_be_trimmed_falls_back_to_a_shorter_prefix():
    index = PrefixIndex()
    short = index.add(P[:4], trimmable=False)
    index.add(P, trimmable=False)
    assert index.match(P) == Match(short, 4, 0, "prefix")
    assert index.match(P[:4]) is None  # the only entry holds the whole prompt: nothing left to compute logits


def test_longer_entry_is_trimmed_back_to_the_prompt():
    index = PrefixIndex()
    e = index.add(P + [1, 2, 3], trimmable=True)
    assert index.match(P) == Match(e, 9, 4, "longer")


def test_diverging_entry_is_trimmed_back_to_the_shared_part():
    index = PrefixIndex()
    e = index.add(P[:7] + [5, 6, 7, 8], trimmable=True)
    assert index.match(P) == Match(e, 7, 4, "diverged")


def test_entries_that_cannot_be_trimmed_never_hand_out_tokens_the_prompt_lacks():
    index = PrefixIndex()
    index.add(P + [1, 2], trimmable=False)  # longer
    index.add(P[:7] + [5, 6], trimmable=False)  # diverges
    assert index.match(P) is None
    short = index.add(P[:3], trimmable=False)
    assert index.match(P) == Match(short, 3, 0, "prefix")


def test_the_entry_that_skips_most_tokens_wins_and_ties_need_no_trim():
    index = PrefixIndex()
    index.add(P[:3], trimmable=True)
    mid = index.add(P[:8], trimmable=True)
    index.add(P[:8] + [0, 0], trimmable=True)  # shares 8 tokens: same as `mid`, but needs trimming
    assert index.match(P) == Match(mid, 8, 0, "prefix")
    far = index.add(P[:9] + [7], trimmable=True)
    assert index.match(P) == Match(far, 9, 1, "diverged")


def test_a_match_shorter_than_the_minimum_is_no_match():
    index = PrefixIndex()
    shared = index.add(P[:3] + [7, 8, 9], trimmable=True)  # shares 3 tokens with P
    prefix = index.add(P[:5], trimmable=False)
    assert index.match(P, min_tokens=5) == Match(prefix, 5, 0, "prefix")
    assert index.match(P, min_tokens=6) is None
    assert index.match(P[:4] + [0, 0], min_tokens=3) == Match(shared, 3, 3, "diverged")
    assert index.match(P[:4] + [0, 0], min_tokens=4) is None


def test_a_prompt_of_one_token_never_matches():
    index = PrefixIndex()
    index.add(P[:1], trimmable=True)
    index.add(P, trimmable=True)
    assert index.match(P[:1]) is None
    assert index.match([]) is None


def test_find_tokens_and_strict_prefixes():
    index = PrefixIndex()
    a = index.add(P[:2], trimmable=True)
    b = index.add(P[:5], trimmable=False)
    c = index.add(P, trimmable=True)
    index.add(P[:5] + [1], trimmable=True)
    assert index.find(P[:5]) == b and index.find(P[:4]) is None and index.find(P + [1]) is None
    assert index.tokens(c) == tuple(P)
    assert index.strict_prefixes(P) == [a, b]
    assert index.strict_prefixes(P[:2]) == []


def test_covering_is_a_trimmable_entry_that_strictly_extends_the_tokens():
    index = PrefixIndex()
    assert index.covering(P[:4]) is None
    index.add(P, trimmable=False)
    assert index.covering(P[:4]) is None  # cannot be trimmed back
    longer = index.add(P + [1], trimmable=True)
    assert index.covering(P[:4]) == longer  # ends inside an edge
    index.add(P[:4], trimmable=True)
    assert index.covering(P[:4]) == longer  # ends at a node
    assert index.covering(P + [1]) is None  # itself, not strictly longer
    assert index.covering(P[:3] + [0]) is None


def test_remove_prunes_and_recompresses_the_tree():
    index = PrefixIndex()
    ids = [index.add(P[:k], trimmable=k % 2 == 0) for k in range(1, 11)]
    ids.append(index.add(P[:5] + [0, 1], trimmable=True))
    for entry_id in ids[::2] + ids[1::2]:
        index.remove(entry_id)
        remaining = [e for e in ids if e in index]
        assert all(index.find(index.tokens(e)) == e for e in remaining)
    assert len(index) == 0 and index.match(P) is None
    assert not index._root.children and index._root.num_trimmable == 0


def test_victims_are_least_recently_used_first_and_skip_pinned_entries():
    index = PrefixIndex()
    a, b, c = (index.add([i, i], trimmable=True) for i in range(3))
    assert index.victims() == [a, b, c]
    index.touch(a)
    index.acquire(b)
    assert index.victims() == [c, a]
    index.acquire(b)
    index.release(b)
    assert index.victims() == [c, a]
    index.release(b)
    assert index.victims() == [b, c, a]
    with pytest.raises(ValueError, match="not pinned"):
        index.release(b)


def test_add_rejects_duplicates_and_empty_sequences():
    index = PrefixIndex()
    index.add(P, trimmable=True)
    with pytest.raises(ValueError, match="already"):
        index.add(P, trimmable=False)
    with pytest.raises(ValueError, match="at least one"):
        index.add([], trimmable=True)
    index.clear()
    assert len(index) == 0 and index.find(P) is None


def _brute_force(entries: dict[int, tuple[tuple[int, ...], bool]], prompt: tuple[int, ...]) -> tuple[int, bool]:
    """The most tokens any entry lets ``prompt`` skip, and whether that many are reachable without trimming."""
    best, untrimmed = 0, False
    for tokens, trimmable in entries.values():
        shared = next((i for i, (a, b) in enumerate(zip(tokens, prompt, strict=False)) if a != b),
                      min(len(tokens), len(prompt)))
        if shared == len(tokens) <= len(prompt) - 1:
            usable, trim = shared, False
        elif trimmable:
            usable, trim = min(shared, len(prompt) - 1), True
        else:
            continue
        if usable > best or (usable == best and not trim):
            best, untrimmed = usable, not trim
    return best, untrimmed


def _check(index: PrefixIndex, entries: dict, prompt: tuple[int, ...]) -> None:
    best, untrimmed = _brute_force(entries, prompt)
    match = index.match(prompt)
    if best == 0:
        assert match is None, (prompt, match)
        return
    assert match is not None and match.num_tokens == best, (prompt, match, best)
    tokens, trimmable = entries[match.entry_id]
    assert tokens[: match.num_tokens] == prompt[: match.num_tokens]
    assert match.num_to_trim == len(tokens) - match.num_tokens
    assert match.num_to_trim == 0 or trimmable
    assert (match.num_to_trim == 0) == untrimmed
    expected_kind = ("prefix" if match.num_to_trim == 0 else "exact" if tokens == prompt
                     else "longer" if tokens[: len(prompt)] == prompt else "diverged")
    assert match.kind == expected_kind


def test_matches_agree_with_a_brute_force_over_random_histories():
    rng = random.Random(7)
    index, entries = PrefixIndex(), {}
    stems = [tuple(rng.randrange(3) for _ in range(12)) for _ in range(4)]

    def sequence() -> tuple[int, ...]:
        stem = rng.choice(stems)
        return stem[: rng.randrange(1, 13)] + tuple(rng.randrange(3) for _ in range(rng.randrange(4)))

    for _ in range(1500):
        tokens = sequence()
        if rng.random() < 0.5 and index.find(tokens) is None:
            trimmable = rng.random() < 0.5
            entries[index.add(tokens, trimmable=trimmable)] = (tokens, trimmable)
        elif entries and rng.random() < 0.3:
            victim = rng.choice(list(entries))
            index.remove(victim)
            del entries[victim]
        _check(index, entries, sequence())
    assert len(index) == len(entries)


def test_importing_the_index_does_not_import_mlx():
    code = "import sys, mlxd.cache.index; assert not any(m.split('.')[0] == 'mlx' for m in sys.modules)"
    subprocess.run([sys.executable, "-c", code], check=True)
