"""An endless, resumable stream of prompt batches over a prompt source's training items: uniform epochs, or MMR1's
variance-aware sampling."""

from __future__ import annotations

import math

import torch

from .types import PromptBatch

SAMPLINGS = ("uniform", "variance")


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


def group_variances(scores: torch.Tensor, prompt_index: torch.Tensor, num_prompts: int) -> list[float | None]:
    """The population variance of each prompt's finite rewards (None when it has none).

    Args:
        scores (`torch.FloatTensor` of shape `[N]`): rewards of a batch (NaN: not applicable).
        prompt_index (`torch.LongTensor` of shape `[N]`): the batch position (0 .. `num_prompts` - 1) of each sample's
            prompt.
    """
    out: list[float | None] = []
    for j in range(num_prompts):
        group = scores[(prompt_index == j) & torch.isfinite(scores)].double()  # [g]
        out.append(float(((group - group.mean()) ** 2).mean()) if len(group) else None)
    return out


class PromptStream:
    """Hands out batches of training items, reproducibly; its whole state is [`state_dict`], so a resumed run
    continues exactly.

    - ``sampling="uniform"``: shuffles the items once per epoch (seeded by ``seed`` and the epoch) and hands them out
      in order; the state is `position` (prompts handed out so far).
    - ``sampling="variance"`` (Variance-Aware Sampling, MMR1: https://arxiv.org/abs/2509.21268): each prompt of a
      batch is drawn, without replacement within the batch, with probability
      ``q_i = mix * v_i / sum_j v_j + (1 - mix) / M`` over the `M` items: with probability `mix` by its Variance
      Promotion Score ``v_i``, otherwise uniformly (the uniform floor: every item keeps at least ``(1 - mix) / M``).
      ``v_i`` is the reward variance of the item's latest group ([`observe`]; for 0/1 rewards ``p (1 - p)``, MMR1's
      outcome variance score); an item not yet seen takes the largest ``v`` seen so far (so it is tried), and while
      every ``v`` is 0 the draw is uniform. MMR1's second term, the diversity of the group's trajectories, is not
      included. The draws of a batch are seeded by ``seed`` and `position`, so they depend on nothing else.
    """

    def __init__(self, items: list[dict], seed: int, position: int = 0, sampling: str = "uniform", mix: float = 0.5):
        if not items:
            raise ValueError("The prompt source has no training prompts.")
        if sampling not in SAMPLINGS:
            raise ValueError(f"prompt sampling must be one of {SAMPLINGS}, got {sampling!r}.")
        if not 0 <= mix < 1:
            raise ValueError(f"the variance-aware sampling mix must be in [0, 1) (1 - mix is the uniform floor), got "
                             f"{mix!r}.")
        self.items = items
        self.seed = seed
        self.position = position
        self.sampling = sampling
        self.mix = mix
        self.scores: list[float | None] = [None] * len(items)  # v_i of each item (None: not seen)
        self.last: list[int] = []  # item indices of the latest batch, in batch order

    @property
    def adaptive(self) -> bool:
        """Whether the stream reads the rewards back ([`observe`])."""
        return self.sampling == "variance"

    def _order(self, epoch: int) -> list[int]:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(len(self.items), generator=generator).tolist()

    def probabilities(self) -> torch.Tensor:
        """The draw probabilities ``q`` `[M]` of every item (see the class docstring)."""
        seen = [v for v in self.scores if v is not None]
        fill = max(seen) if seen else 0.0
        v = torch.tensor([fill if s is None else s for s in self.scores], dtype=torch.float64)  # [M]
        uniform = torch.full_like(v, 1.0 / len(v))
        total = float(v.sum())
        if total <= 0 or not math.isfinite(total):
            return uniform
        return self.mix * v / total + (1 - self.mix) * uniform

    def next_batch(self, size: int) -> PromptBatch:
        if self.adaptive:
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + 7_919 * (self.position + 1))
            if size <= len(self.items):
                chosen = torch.multinomial(self.probabilities(), size, replacement=False, generator=generator)
            else:  # more prompts than items: every batch repeats some
                chosen = torch.multinomial(self.probabilities(), size, replacement=True, generator=generator)
            self.last = chosen.tolist()
            self.position += size
        else:
            self.last = []
            while len(self.last) < size:
                epoch, offset = divmod(self.position, len(self.items))
                self.last.append(self._order(epoch)[offset])
                self.position += 1
        return items_to_batch([self.items[i] for i in self.last])

    def observe(self, scores: torch.Tensor, prompt_index: torch.Tensor) -> None:
        """Records the rewards of the latest batch's groups: ``v`` of each of its items becomes its group's reward
        variance (a group without a finite reward leaves ``v`` as it was).

        Args:
            scores (`torch.FloatTensor` of shape `[N]`): the gathered rewards of the batch.
            prompt_index (`torch.LongTensor` of shape `[N]`): the batch position of each sample's prompt.
        """
        for item, variance in zip(self.last, group_variances(scores, prompt_index, len(self.last))):
            if variance is not None:
                self.scores[item] = variance

    def state_dict(self) -> dict:
        """`position`, and under variance-aware sampling each item's ``v`` (null: not seen); JSON-serialisable."""
        state = {"position": self.position}
        if self.adaptive:
            state["variance_scores"] = list(self.scores)
        return state

    def load_state_dict(self, state: dict) -> None:
        self.position = state["position"]
        if self.adaptive:
            scores = state.get("variance_scores")
            if scores is None or len(scores) != len(self.items):
                raise ValueError(f"the checkpoint's prompt-stream state has no variance scores for the "
                                 f"{len(self.items)} training items (it was saved with other prompt sampling or "
                                 f"another prompt source); resume with the same train.prompt_sampling and data.")
            self.scores = [None if s is None else float(s) for s in scores]
