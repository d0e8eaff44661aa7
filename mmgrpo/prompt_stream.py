"""An endless, resumable stream of prompt batches over a prompt source's training items."""

from __future__ import annotations

import torch

from .types import PromptBatch


def items_to_batch(items: list[dict]) -> PromptBatch:
    """``[{"prompt": str, "metadata": dict, **conditions}, ...]`` -> [`PromptBatch`]."""
    conditions = {}
    for key in items[0] if items else []:
        if key not in ("prompt", "metadata"):
            conditions[key] = [item[key] for item in items]
    return PromptBatch(
        prompts=[item["prompt"] for item in items],
        metadata=[item.get("metadata", {}) for item in items],
        conditions=conditions,
    )


class PromptStream:
    """Shuffles the items once per epoch (seeded by ``seed`` and the epoch) and hands out batches in order.

    The whole state is `position` (prompts handed out so far), so a resumed run continues exactly.
    """

    def __init__(self, items: list[dict], seed: int, position: int = 0):
        if not items:
            raise ValueError("The prompt source has no training prompts.")
        self.items = items
        self.seed = seed
        self.position = position

    def _order(self, epoch: int) -> list[int]:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(len(self.items), generator=generator).tolist()

    def next_batch(self, size: int) -> PromptBatch:
        chosen = []
        while len(chosen) < size:
            epoch, offset = divmod(self.position, len(self.items))
            chosen.append(self.items[self._order(epoch)[offset]])
            self.position += 1
        return items_to_batch(chosen)
