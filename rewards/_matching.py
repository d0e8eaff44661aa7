"""Maximum-weight one-to-one matching (the assignment problem) for multi-object rewards (not a plugin).

Uses scipy's `linear_sum_assignment` when scipy is installed, else an exact O(n^2 m) Hungarian algorithm (shortest
augmenting paths with potentials), fine for the tens of objects a generated answer holds.
"""

from __future__ import annotations

import torch


def _hungarian_min_cost(cost: list[list[float]]) -> list[tuple[int, int]]:
    """Minimum-cost assignment of every row of an `n x m` cost matrix (``n <= m``) to a distinct column."""
    n, m = len(cost), len(cost[0])
    inf = float("inf")
    u, v = [0.0] * (n + 1), [0.0] * (m + 1)  # row and column potentials (1-based, 0 is a sentinel)
    owner, way = [0] * (m + 1), [0] * (m + 1)  # owner[j]: row matched to column j; way: augmenting path
    for row in range(1, n + 1):
        owner[0], col = row, 0
        slack, used = [inf] * (m + 1), [False] * (m + 1)
        while owner[col] != 0:
            used[col] = True
            current, delta, next_col = owner[col], inf, 0
            for j in range(1, m + 1):
                if not used[j]:
                    reduced = cost[current - 1][j - 1] - u[current] - v[j]
                    if reduced < slack[j]:
                        slack[j], way[j] = reduced, col
                    if slack[j] < delta:
                        delta, next_col = slack[j], j
            for j in range(m + 1):
                if used[j]:
                    u[owner[j]] += delta
                    v[j] -= delta
                else:
                    slack[j] -= delta
            col = next_col
        while col:  # flip the augmenting path
            previous = way[col]
            owner[col] = owner[previous]
            col = previous
    return [(owner[j] - 1, j - 1) for j in range(1, m + 1) if owner[j]]


def max_weight_matching(weights: torch.Tensor) -> list[tuple[int, int]]:
    """Pairs ``(row, column)`` maximising the total weight, each row and column used at most once.

    Args:
        weights (`torch.FloatTensor` of shape `[P, G]`): e.g. IoU of every predicted box with every ground-truth box.

    Returns:
        `list[tuple[int, int]]`: ``min(P, G)`` pairs, sorted by row.
    """
    if weights.numel() == 0:
        return []
    try:
        from scipy.optimize import linear_sum_assignment
    except ImportError:
        linear_sum_assignment = None
    if linear_sum_assignment is not None:
        rows, cols = linear_sum_assignment(weights.double().numpy(), maximize=True)
        return sorted(zip(rows.tolist(), cols.tolist()))
    cost = (-weights.double()).tolist()
    if weights.shape[0] <= weights.shape[1]:
        return sorted(_hungarian_min_cost(cost))
    transposed = [list(column) for column in zip(*cost)]
    return sorted((row, col) for col, row in _hungarian_min_cost(transposed))
