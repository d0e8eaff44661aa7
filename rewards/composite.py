"""Composite reward: a weighted sum of named registered rewards, optionally normalised per group.

Two normalisations, as TRL's ``multi_objective_aggregation`` names them (``normalize_then_sum`` is GDPO's), see
https://huggingface.co/docs/trl/main/en/grpo_trainer :

- ``"sum_then_normalize"``: ``s = sum_k w_k r_k``, then ``(s - mean_group(s)) / (std_group(s) + eps)``.
- ``"normalize_then_sum"``: ``s = sum_k w_k (r_k - mean_group(r_k)) / (std_group(r_k) + eps)``, so a reward with a
  large spread cannot drown the others.
- ``"none"``: the plain weighted sum (the algorithm's own group normalisation then applies).

A normalising composite scores in two stages (see `mmgrpo.protocols.RewardFn`): ``__call__`` returns each sample's
weighted sum and components on its process, then its ``group_stage`` normalises on the batch gathered from every
process, so a group that spans processes is normalised as a whole. Group statistics use the global group ids (the
whole batch is one group without them), population std, ``eps`` 1e-4, over the finite values only
(`mmgrpo.advantages.group_normalize`). A component that is NaN ("not applicable") for a sample is left out of that
sample's sum; a sample for which every component is NaN scores NaN. A component must score per sample (a normalising
composite inside a composite is refused: normalise in the outer one).

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


@dataclass
class CompositeConfig:
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


class CompositeReward:
    """Sums the scores of several rewards, each built from its own options."""

    Config = CompositeConfig
    modalities = frozenset()  # depends on the components; an instance holds the union of theirs
    group_stage = None  # the class default; an instance that normalises per group holds its own

    def __init__(self, config: CompositeConfig):
        self.config = config
        self.rewards = {key: registry.get("reward", name)(options) for key, (name, _, options) in config.specs.items()}
        self.weights = {key: weight for key, (_, weight, _) in config.specs.items()}
        self.modalities = frozenset().union(*(reward.modalities for reward in self.rewards.values()))
        staged = [key for key, reward in self.rewards.items() if reward.group_stage is not None]
        if staged:
            raise ValueError(f"composite: reward.rewards.{staged[0]} scores against its group; a component must score "
                             "per sample: set its normalize to none and normalise in this composite.")
        if config.normalize != "none":
            self.group_stage = self.normalize_per_group  # after the gather (see the module docstring)

    def __call__(self, outputs: dict[str, Any], batch: PromptBatch) -> RewardResult:
        """Returns each sample's weighted sum `[N]` (NaN where no component applies) and every component's score and
        parts, each `[N]`; a normalising composite normalises it in [`normalize_per_group`], its group stage."""
        components, terms = {}, []
        for key, reward in self.rewards.items():
            result = reward(outputs, batch)
            score = result.scores.detach().float().cpu()  # [N]
            components[key] = score
            components.update({f"{key}/{name}": value.detach().float().cpu() for name, value in result.components.items()})
            terms.append(self.weights[key] * score)
        total = _nan_sum(torch.stack(terms))  # [N]
        components["weighted_sum"] = _nan_sum(torch.stack([self.weights[k] * components[k] for k in self.rewards]))
        return RewardResult(scores=total.float(), components=components)

    def normalize_per_group(self, result: RewardResult, group_ids: torch.Tensor | None) -> RewardResult:
        """The group stage: `result` of the whole batch (``scores`` `[N]`, ``components`` each `[N]`) and its global
        `group_ids` `[N]` (`None`: one group) -> the scores normalised per group, ``sum_then_normalize`` or
        ``normalize_then_sum``, and the same components."""
        eps = self.config.eps
        if self.config.normalize == "normalize_then_sum":
            parts = {k: normalize_groups(result.components[k].float(), group_ids, eps) for k in self.rewards}
            total = _nan_sum(torch.stack([self.weights[k] * parts[k] for k in self.rewards]))  # [N]
        else:
            total = normalize_groups(result.scores.float(), group_ids, eps)  # [N]
        return RewardResult(scores=total.float(), components=dict(result.components), features=result.features)


def _nan_sum(stacked: torch.Tensor) -> torch.Tensor:
    """The sum over the first dimension of `stacked` `[K, N]` leaving out NaN terms; NaN where every term is NaN."""
    applicable = torch.isfinite(stacked).any(dim=0)  # [N]
    return torch.where(applicable, torch.nansum(stacked, dim=0), torch.full_like(stacked[0], float("nan")))


PLUGIN = CompositeReward
