"""An endless, resumable stream of prompt batches over a prompt source's training items: uniform epochs, MMR1's
variance-aware sampling, or mmgrpo's cheap variant of it by the training groups' reward variance."""

from __future__ import annotations

import math

import torch

from .seeding import mix_seed
from .types import PromptBatch

SAMPLINGS = ("uniform", "group_variance", "vas")
VAS_EPS = 1e-8  # MMR1's min-max normalisation: (v - min) / (max - min + 1e-8)


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
    - ``sampling="vas"``: MMR1's Variance-Aware Sampling (https://arxiv.org/abs/2509.21268; options `vas`, a
      [`~mmgrpo.vas.VASConfig`]). [`refresh`] takes each scored prompt's accuracies over extra rollouts (the trainer
      samples them, [`mmgrpo.vas.refresh_weights`], when [`refresh_due`]): ``p`` their mean, the learnability
      ``v = p (1 - p)``, weights ``w = (v - min v) / (max v - min v + 1e-8)`` over all items, then
      ``w = momentum * w_old + (1 - momentum) * w`` after the first refresh. A batch of `B` prompts holds
      ``int(B * mix)`` drawn with replacement with probabilities ``w / sum(w)`` (uniformly while every weight is 0)
      and ``B - int(B * mix)`` taken in order from one shuffled permutation of the items (seeded once, never
      reshuffled; when fewer than needed are left it starts again from its beginning, as MMR1's sampler), interleaved
      weighted, pooled, weighted, pooled... The weighted draws of a batch are seeded by ``seed`` and `position`.
    - ``sampling="group_variance"`` (mmgrpo's cheap variant, no extra rollouts): each prompt of a batch is drawn,
      without replacement within the batch, with probability ``q_i = mix * v_i / sum_j v_j + (1 - mix) / M`` over the
      `M` items, ``v_i`` the population reward variance of the item's latest training group ([`observe`]; for 0/1
      rewards ``p (1 - p)``); an item not yet seen takes the largest ``v`` seen so far, and while every ``v`` is 0 the
      draw is uniform. No min-max normalisation, refresh cadence or batch split.
    """

    def __init__(self, items: list[dict], seed: int, position: int = 0, sampling: str = "uniform", mix: float = 0.5,
                 vas: "VASConfig | None" = None):
        if not items:
            raise ValueError("The prompt source has no training prompts.")
        if sampling not in SAMPLINGS:
            raise ValueError(f"prompt sampling must be one of {SAMPLINGS}, got {sampling!r}.")
        if not (0 <= mix <= 1 if sampling == "vas" else 0 <= mix < 1):
            raise ValueError(f"the prompt sampling mix must be in [0, 1) under group_variance (1 - mix is the uniform "
                             f"floor), in [0, 1] under vas, got {mix!r}.")
        if sampling == "vas" and vas is None:
            raise ValueError("prompt sampling 'vas' needs its options (a mmgrpo.vas.VASConfig).")
        self.items, self.seed, self.position, self.sampling, self.mix = items, seed, position, sampling, mix
        self.vas = vas
        self.scores: list[float | None] = [None] * len(items)  # group_variance: v_i (None: not seen); vas: p (1 - p)
        self.last: list[int] = []  # item indices of the latest batch, in batch order
        self.weights: list[float] | None = None  # vas: the weight of each item (None: before the first refresh)
        self.pool_position = 0  # vas: items taken from the shuffled pool so far (mod its length, MMR1's wrap)
        self.refreshed_at: int | None = None  # vas: the trainer steps completed at the latest refresh
        self.score_cursor = 0  # vas with score_prompts: where the next refresh starts in the scoring order

    @property
    def adaptive(self) -> bool:
        """Whether the stream reads the training rewards back ([`observe`])."""
        return self.sampling == "group_variance"

    def _order(self, epoch: int) -> list[int]:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(len(self.items), generator=generator).tolist()

    def _permutation(self, purpose: int) -> list[int]:
        """``vas``: a permutation of the items fixed for the run: the pool (`purpose` 1) or the scoring order (2)."""
        generator = torch.Generator().manual_seed(mix_seed(self.seed, purpose, offset=11))
        return torch.randperm(len(self.items), generator=generator).tolist()

    def _generator(self) -> torch.Generator:
        """The generator of the draws of the batch at `position` (depends on nothing else)."""
        return torch.Generator().manual_seed(self.seed * 1_000_003 + 7_919 * (self.position + 1))

    def probabilities(self) -> torch.Tensor:
        """``group_variance``: the draw probabilities ``q`` `[M]` of every item (see the class docstring)."""
        seen = [v for v in self.scores if v is not None]
        fill = max(seen) if seen else 0.0
        v = torch.tensor([fill if s is None else s for s in self.scores], dtype=torch.float64)  # [M]
        uniform = torch.full_like(v, 1.0 / len(v))
        total = float(v.sum())
        if total <= 0 or not math.isfinite(total):
            return uniform
        return self.mix * v / total + (1 - self.mix) * uniform

    def next_batch(self, size: int) -> PromptBatch:
        if self.sampling == "vas":
            self.last = self._vas_batch(size)
            self.position += size
        elif self.adaptive:
            replacement = size > len(self.items)  # more prompts than items: every batch repeats some
            chosen = torch.multinomial(self.probabilities(), size, replacement=replacement, generator=self._generator())
            self.last = chosen.tolist()
            self.position += size
        else:
            self.last = []
            while len(self.last) < size:
                epoch, offset = divmod(self.position, len(self.items))
                self.last.append(self._order(epoch)[offset])
                self.position += 1
        return items_to_batch([self.items[i] for i in self.last])

    # ------------------------------------------------------------------------------------------ vas (MMR1)
    def draw_probabilities(self) -> torch.Tensor:
        """``vas``: the probabilities `[M]` of a weighted draw, ``w / sum(w)`` (uniform before the first refresh or
        while every weight is 0)."""
        weights = torch.tensor(self.weights or [0.0] * len(self.items), dtype=torch.float64)  # [M]
        total = float(weights.sum())
        return weights / total if total > 0 else torch.full_like(weights, 1.0 / len(weights))

    def _vas_batch(self, size: int) -> list[int]:
        """``int(size * mix)`` weighted draws and the next items of the shuffled pool, interleaved."""
        weighted_n = int(size * self.mix)
        weighted = torch.multinomial(self.draw_probabilities(), weighted_n, replacement=True,
                                     generator=self._generator()).tolist() if weighted_n else []
        pool, pooled_n = self._permutation(1), size - weighted_n  # one permutation for the whole run
        if self.pool_position + pooled_n > len(pool):
            self.pool_position = 0  # MMR1: start again from the beginning, the tail left out, no reshuffle
        pooled = [pool[(self.pool_position + k) % len(pool)] for k in range(pooled_n)]
        self.pool_position += pooled_n
        mixed = []
        for k in range(max(weighted_n, pooled_n)):
            mixed += weighted[k : k + 1] + pooled[k : k + 1]
        return mixed

    def refresh_due(self, completed_steps: int) -> bool:
        """``vas``: whether the weights are to be refreshed before the next step: before the first one, then after
        every ``vas.update_every`` steps (once per step count, also after a resume)."""
        if self.sampling != "vas":
            return False
        if self.weights is None:
            return True
        return completed_steps % self.vas.update_every == 0 and completed_steps != self.refreshed_at

    def items_to_score(self) -> list[int]:
        """``vas``: the items the next refresh scores: all of them, or the next ``vas.score_prompts`` of a fixed
        shuffled order (cycling)."""
        count = self.vas.score_prompts
        if not count or count >= len(self.items):
            return list(range(len(self.items)))
        order = self._permutation(2)
        return [order[(self.score_cursor + k) % len(order)] for k in range(count)]

    def refresh(self, accuracies: dict[int, torch.Tensor], completed_steps: int) -> dict[str, float]:
        """``vas``: new weights from each scored item's accuracies (`[n]` each, NaN: not applicable) after
        `completed_steps` trainer steps (see the class docstring). Returns the metrics ``vas/*``."""
        means = []
        for item, values in accuracies.items():
            values = torch.as_tensor(values, dtype=torch.float64)
            values = values[torch.isfinite(values)]
            p = float(values.mean()) if values.numel() else None
            self.scores[item] = 0.0 if p is None else p * (1 - p)  # learnability; 0 without a finite accuracy
            means += [] if p is None else [p]
        known = [v for v in self.scores if v is not None]
        v = torch.tensor([max(known) if s is None else s for s in self.scores], dtype=torch.float64)  # [M]
        new = (v - v.min()) / (v.max() - v.min() + VAS_EPS)  # [M] min-max
        if self.weights is not None:
            new = self.vas.momentum * torch.tensor(self.weights, dtype=torch.float64) + (1 - self.vas.momentum) * new
        self.weights = new.tolist()
        self.refreshed_at = completed_steps
        if self.vas.score_prompts and self.vas.score_prompts < len(self.items):
            self.score_cursor = (self.score_cursor + self.vas.score_prompts) % len(self.items)
        return {"vas/mean_weight": float(new.mean()), "vas/min_weight": float(new.min()),
                "vas/max_weight": float(new.max()), "vas/scored_prompts": float(len(accuracies)),
                "vas/mean_accuracy": sum(means) / len(means) if means else float("nan")}

    def observe(self, scores: torch.Tensor, prompt_index: torch.Tensor) -> None:
        """``group_variance``: records the rewards of the latest batch's groups: ``v`` of each of its items becomes
        its group's reward variance (a group without a finite reward leaves ``v`` as it was).

        Args:
            scores (`torch.FloatTensor` of shape `[N]`): the gathered rewards of the batch.
            prompt_index (`torch.LongTensor` of shape `[N]`): the batch position of each sample's prompt.
        """
        for item, variance in zip(self.last, group_variances(scores, prompt_index, len(self.last))):
            if variance is not None:
                self.scores[item] = variance

    def state_dict(self) -> dict:
        """`position`; under ``group_variance`` each item's ``v`` (null: not seen); under ``vas`` the weights, the
        scores, the pool position, the step of the latest refresh and the scoring cursor. JSON-serialisable."""
        state = {"position": self.position}
        if self.adaptive:
            state["variance_scores"] = list(self.scores)
        if self.sampling == "vas":
            state["vas"] = {"weights": self.weights, "scores": list(self.scores), "pool_position": self.pool_position,
                            "refreshed_at": self.refreshed_at, "score_cursor": self.score_cursor}
        return state

    def load_state_dict(self, state: dict) -> None:
        self.position = state["position"]
        key = {"group_variance": "variance_scores", "vas": "vas"}.get(self.sampling)
        if key is None:
            return
        saved = state.get(key)
        scores = saved.get("scores") if isinstance(saved, dict) else saved
        if scores is None or len(scores) != len(self.items):
            raise ValueError(f"the checkpoint's prompt-stream state has no {self.sampling} state for the "
                             f"{len(self.items)} training items (it was saved with other prompt sampling or another "
                             "prompt source); resume with the same train.prompt_sampling and data.")
        self.scores = [None if s is None else float(s) for s in scores]
        if isinstance(saved, dict):
            self.weights = None if saved["weights"] is None else [float(w) for w in saved["weights"]]
            self.pool_position, self.refreshed_at = int(saved["pool_position"]), saved["refreshed_at"]
            self.score_cursor = int(saved["score_cursor"])
