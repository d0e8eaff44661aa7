"""Out-of-distribution held-out splits of the synthetic sources, shared by them: the rule of unseen combinations
(`shapes_edit`, `seg_shapes`) and drawing a split's items from a range of indices by a rule.

A source that generates such a split declares it in ``eval_splits()`` (see `mmgrpo.protocols.PromptSource`) beside its
in-distribution ``eval`` split; its rule is exact (no training item satisfies it, every item of the split does) and
its items depend on the source's options and seed alone.
"""

from __future__ import annotations

import itertools
from typing import Callable

# indices of a source's items are offset by seed * SEED_STRIDE; training items start there, the in-distribution
# held-out items at + EVAL_OFFSET, the out-of-distribution ones at + OOD_OFFSET (disjoint ranges for the sizes used)
SEED_STRIDE, EVAL_OFFSET, OOD_OFFSET = 1_000_003, 500_000, 800_000
OOD = "ood"  # the name of the out-of-distribution split


def held_out_combinations(*axes) -> frozenset[tuple]:
    """The combinations (one value of each axis, in axis order) held out of training: those whose positions in their
    axes sum to a multiple of the last axis's length. For any choice of the values of the other axes exactly one value
    of the last axis is held out, so every value of the other axes still occurs in training, and so does every value
    of the last axis where the other axes' positions reach two different sums modulo its length (e.g. kinds x shapes
    x the four colours: 9 of 36 held out, each (kind, shape) with one colour, each colour with 2 or 3 (kind, shape)).

    Args:
        *axes: the values of each axis, in a fixed order (e.g. ``("circle", "square", "triangle")``).
    """
    size = len(axes[-1])
    return frozenset(
        tuple(value for _, value in combo)
        for combo in itertools.product(*(list(enumerate(axis)) for axis in axes))
        if sum(position for position, _ in combo) % size == 0
    )


def items_by_rule(make: Callable[[int], dict | None], start: int, count: int) -> list[dict]:
    """`count` items ``make(index)`` for the indices from `start` on, skipping the indices whose `make` gives None (no
    item of the split there).

    Raises:
        `ValueError`: fewer than one index in 1000 gives an item (the split's rule leaves almost nothing to draw).
    """
    out, index = [], start
    while len(out) < count:
        if index - start > 1000 * (count + 10):
            raise ValueError(f"only {len(out)} of {count} items found in {index - start} indices: the split's rule "
                             "admits almost no item of these options.")
        made = make(index)
        if made is not None:
            out.append(made)
        index += 1
    return out
