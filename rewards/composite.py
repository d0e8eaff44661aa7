"""Composite reward: a weighted sum of named registered rewards, optionally normalised per group.

Two normalisations, as TRL's ``multi_objective_aggregation`` names them (``normalize_then_sum`` is GDPO's), see
https://huggingface.co/docs/trl/main/en/grpo_trainer :

- ``"sum_then_normalize"``: ``s = sum_k w_k r_k``, then ``(s - mean_group(s)) / (std_group(s) + eps)``.
- ``"normalize_then_sum"``: ``s = sum_k w_k (r_k - mean_group(r_k)) / (std_group(r_k) + eps)``, so a reward with a
  large spread cannot drown the others.
- ``"none"``: the plain weighted sum (the algorithm's own group normalisation then applies).

Group statistics use `batch.group_ids` (the whole call is one group without them), population std, ``eps`` 1e-4, over
the finite values only (`mmgrpo.advantages.group_normalize`). A component that is NaN ("not applicable") for a sample
is left out of that sample's sum; a sample for which every component is NaN scores NaN. The groups are those present
in the call, so a normalising composite sets ``needs_whole_groups`` and the trainer refuses to split a group across
processes (each part would be normalised on its own).

Config: ``rewards`` maps a component name to ``{name: <registered reward, defaults to the component name>, weight:
<float, defaults to 1>, **that reward's options}``, e.g.::

    reward:
      name: composite
      normalize: normalize_then_sum
      rewards:
        format: {weight: 0.1}
        accuracy: {weight: 0.9, mode: numeric}

`components` hold each reward's score under its component name, that reward's own components as ``<name>/<key>``, and
``weighted_sum`` (before any normalisation).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from mmgrpo import registry
from mmgrpo.advantages import group_normalize
from mmgrpo.config import build_dataclass
from mmgrpo.types import PromptBatch, RewardResult
from mmgrpo.validation import check_fields, coerce

RESERVED = ("name", "weight")


def normalize_groups(values: torch.Tensor, group_ids: torch.Tensor | None, eps: float) -> torch.Tensor:
    """Per-group z-scores of `values` `[N]` over the finite entries; NaN stays NaN."""
    groups = torch.zeros(values.shape[0], dtype=torch.long) if group_ids is None else group_ids.cpu()
    normalized = group_normalize(values, groups, eps=eps)  # [N], 0 where not finite
    return torch.where(torch.isfinite(values), normalized, torch.full_like(normalized, float("nan")))


class CompositeReward:
    """Sums the scores of several rewards, each built from its own options."""

    @dataclass
    class Config:
        """Configuration of [`CompositeReward`].

        Args:
            rewards (`dict[str, dict]`): component name -> ``{name, weight, **options}`` (see the module docstring).
            normalize (`str`, defaults to `"none"`): ``"none"``, ``"sum_then_normalize"`` or ``"normalize_then_sum"``.
            eps (`float`, defaults to 1e-4): added to the group standard deviation.
        """

        rewards: dict[str, dict] = field(default_factory=dict)
        normalize: Literal["none", "sum_then_normalize", "normalize_then_sum"] = "none"
        eps: float = 1e-4

        def __post_init__(self):
            check_fields(self)
            if not self.rewards:
                raise ValueError("composite: reward.rewards is empty; name at least one reward, e.g. {format: {weight: 1.0}}.")
            if self.eps <= 0:
                raise ValueError(f"composite.eps must be > 0, got {self.eps}.")
            self.specs = {}  # component name -> (registry name, weight, plugin Config instance); not a field
            for key, raw in self.rewards.items():
                if not isinstance(raw, dict):
                    raise ValueError(f"composite: reward.rewards.{key} must be a mapping of options, got {raw!r}.")
                options = {k: v for k, v in raw.items() if k not in RESERVED}
                name = coerce(raw.get("name", key), str, f"rewards.{key}.name")
                weight = coerce(raw.get("weight", 1.0), float, f"rewards.{key}.weight")  # a finite number
                plugin = registry.get("reward", name)
                self.specs[key] = (name, weight, build_dataclass(plugin.Config, options, f"reward.rewards.{key}"))

    modalities = frozenset()  # depends on the components; an instance holds the union of theirs

    def __init__(self, config: "CompositeReward.Config"):
        self.config = config
        self.rewards = {key: registry.get("reward", name)(options) for key, (name, _, options) in config.specs.items()}
        self.weights = {key: weight for key, (_, weight, _) in config.specs.items()}
        self.modalities = frozenset().union(*(reward.modalities for reward in self.rewards.values()))
        self.needs_whole_groups = config.normalize != "none"  # group statistics see only this call's samples

    def __call__(self, outputs: dict[str, Any], batch: PromptBatch) -> RewardResult:
        """Returns the (normalised) weighted sum `[N]` and every component's score and parts, each `[N]`."""
        mode, eps = self.config.normalize, self.config.eps
        components, terms = {}, []
        for key, reward in self.rewards.items():
            result = reward(outputs, batch)
            score = result.scores.detach().float().cpu()  # [N]
            components[key] = score
            components.update({f"{key}/{name}": value.detach().float().cpu() for name, value in result.components.items()})
            term = normalize_groups(score, batch.group_ids, eps) if mode == "normalize_then_sum" else score
            terms.append(self.weights[key] * term)
        stacked = torch.stack(terms)  # [K, N]
        applicable = torch.isfinite(stacked).any(dim=0)  # [N]
        total = torch.where(applicable, torch.nansum(stacked, dim=0), torch.full_like(stacked[0], float("nan")))
        components["weighted_sum"] = torch.where(
            applicable, torch.nansum(torch.stack([self.weights[k] * components[k] for k in self.rewards]), dim=0),
            torch.full_like(total, float("nan")),
        )
        if mode == "sum_then_normalize":
            total = normalize_groups(total, batch.group_ids, eps)
        return RewardResult(scores=total.float(), components=components)


PLUGIN = CompositeReward
