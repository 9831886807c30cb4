"""Splitting a batch of sequences into attention groups of similar context lengths."""

from __future__ import annotations

import itertools
import random

from cloud.engine.attention import split_by_context


def _cost(groups: list[list[int]], blocks: list[int], group_cost: float) -> float:
    return sum(len(g) * max(blocks[i] for i in g) + group_cost for g in groups)


def _best_cost(blocks: list[int], group_cost: float) -> float:
    """Every partition of the sorted lengths into contiguous runs (the optimum is among them)."""
    lengths = sorted(blocks)
    n = len(lengths)
    best = float("inf")
    for k in range(n):
        for cuts in itertools.combinations(range(1, n), k):
            bounds = [0, *cuts, n]
            cost = sum((j - i) * lengths[j - 1] + group_cost for i, j in itertools.pairwise(bounds))
            best = min(best, cost)
    return best


def test_groups_are_a_partition_with_the_least_padded_work() -> None:
    rng = random.Random(7)
    for _ in range(200):
        blocks = [rng.randint(1, 12) for _ in range(rng.randint(1, 9))]
        group_cost = rng.choice([0.0, 1.0, 3.0, 10.0, 100.0])
        groups = split_by_context(blocks, group_cost)
        assert sorted(i for g in groups for i in g) == list(range(len(blocks)))
        assert all(groups)
        assert _cost(groups, blocks, group_cost) == _best_cost(blocks, group_cost)


def test_a_costly_group_keeps_one_group_and_a_free_one_splits_every_length() -> None:
    blocks = [25, 1, 3, 25, 3, 9]
    assert split_by_context(blocks, 1e9) == [[1, 2, 4, 5, 0, 3]]
    assert [sorted(g) for g in split_by_context(blocks, 0.0)] == [[1], [2, 4], [5], [0, 3]]
    assert split_by_context([], 1.0) == []
    assert split_by_context([4], 1.0) == [[0]]


def test_many_distinct_lengths_are_rounded_for_the_choice_of_split_points_only() -> None:
    rng = random.Random(3)
    blocks = [rng.randint(1, 500) for _ in range(256)]
    groups = split_by_context(blocks, 24.0, max_points=48)
    assert sorted(i for g in groups for i in g) == list(range(256))
    # Well under the single group's padded work, and each group's own maximum is what it is padded to.
    assert _cost(groups, blocks, 24.0) < 0.7 * _cost([list(range(256))], blocks, 24.0)
    assert len(groups) <= 48
