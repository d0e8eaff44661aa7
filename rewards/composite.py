"""Composite reward: a weighted sum of named registered rewards, optionally normalised per group.

``normalize`` chooses how the components become one training signal. TRL's two ``multi_objective_aggregation`` rules
(https://huggingface.co/docs/trl/main/en/grpo_trainer), exactly, with the component weights as TRL's
``reward_weights``:

- ``"sum_then_normalize"`` (TRL's default): the score is ``s = sum_k w_k r_k``; the algorithm's advantage step is the
  normalisation, ``(s - mean_group(s)) / (std + eps)`` under its ``scale_rewards`` (``group``: the group's std,
  ``batch``: the batch's, ``none``: no division). With TRL's estimator and epsilon (``adv_std: unbiased``,
  ``adv_eps: 1e-4``, the defaults of ``grpo``, ``dapo``, ``gspo``, ``sapo``) the advantages are TRL's. The composite
  itself scores as ``"none"``.
- ``"normalize_then_sum"``: each component is z-scored within its group, ``z_k = (r_k - mean_group(r_k)) /
  (std_group(r_k) + 1e-4)`` (unbiased std over the group's non-NaN values; NaN with fewer than two), summed with the
  weights, ``s = sum_k w_k z_k``, and then z-scored over the whole batch, ``A = (s - mean(s)) / (std(s) + 1e-4)``
  (unbiased). ``A`` is the advantage, as in TRL: the group stage's result declares ``scores_are_advantages`` and the
  trainer uses it as it is, instead of the algorithm's advantage step (whose ``scale_rewards``, ``adv_std``,
  ``adv_eps``, ``advantage_transform`` and ``adv_clip_max`` therefore do not apply; TRL ignores ``scale_rewards``
  here too). A batch z-score reads the whole batch: ``train.group_placement: contiguous`` is refused, and such a
  composite cannot be a component of another.

MixGRPO's ``multi_reward_mix`` default (https://arxiv.org/abs/2507.21802, ``train_grpo_flux.py``), exactly, with the
component weights as its reward weights; DanceGRPO's multi-reward rule (separate advantages per reward):

- ``"advantage_aggr"``: each component is normalised within its group as the fastvideo scripts do, ``A_k = (r_k -
  mean_group(r_k)) / (std_group(r_k) + 1e-8)`` (PyTorch's unbiased std; a group whose values are all equal gets 0),
  and the advantage is their weighted sum, ``A = sum_k w_k A_k``, with no batch z-score. ``A`` is the advantage: the
  result declares ``scores_are_advantages`` (the algorithm's ``scale_rewards``, ``adv_std``, ``adv_eps`` and
  ``advantage_transform`` do not apply; `dance_grpo` and `mix_grpo` still clamp it to ``adv_clip_max`` in their loss,
  as the authors). DanceGRPO's HunyuanVideo script adds the weighted clipped losses of the per-reward advantages
  instead, the same wherever the ratio lies inside its clip. As for ``normalize_then_sum``, the stage runs on the
  gathered batch: ``train.group_placement: contiguous`` is refused.

The per-group variants, mmgrpo's own (population std, ``eps``; the algorithm then computes advantages from the scores):

- ``"sum_then_group_normalize"``: ``(s - mean_group(s)) / (std_group(s) + eps)``.
- ``"group_normalize_then_sum"``: ``s = sum_k w_k (r_k - mean_group(r_k)) / (std_group(r_k) + eps)``, so a reward
  with a large spread cannot drown the others; no batch z-score.
- ``"none"``: the plain weighted sum (the algorithm's own group normalisation then applies).

Not applicable (NaN, TRL's ``None``): a NaN term is left out of a sample's sum (TRL's ``nansum``) and out of the group
statistics; a sample for which every component is NaN scores NaN, and so gets advantage 0 and is not scored by the
trainer (TRL: advantage 0).

A normalising composite, and one with a component that scores against its group (``dpp_diversity``, a normalising
composite), scores in two stages (see `mmgrpo.protocols.RewardFn`): ``__call__`` returns each sample's weighted sum,
components and the group-level components' ``features`` (side by side, ``[n, D_1 + D_2 + ...]``) on its process; then
its ``group_stage``, on the batch gathered from every process, runs each group-level component's own group stage on its
score, components and features, sums again, and normalises, so a group that spans processes is scored as a whole.
Group statistics use the global group ids (the whole batch is one group without them).

Config: ``rewards`` maps a component name to ``{name: <registered reward, defaults to the component name>, weight:
<float, defaults to 1>, **that reward's options}``, e.g.::

    reward:
      name: composite
      normalize: normalize_then_sum
      rewards:
        format: {weight: 0.1}
        accuracy: {weight: 0.9, mode: numeric}

`components` hold each reward's score under its component name, that reward's own components as ``<name>/<key>``, and
``weighted_sum`` (after the components' group stages, before any normalisation). Its modalities are the union of its
components' and its artifacts (for the sample writers, e.g. `sam_mask`'s masks) are theirs, each kind added by one
component only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from mmgrpo import registry
from mmgrpo.advantages import group_normalize
from mmgrpo.config import build_dataclass
from mmgrpo.types import PromptBatch, RewardResult
from mmgrpo.rewards._common import WEIGHT_LIMIT
from mmgrpo.validation import check_fields, check_range, coerce

RESERVED = ("name", "weight")
NORMALIZATIONS = ("none", "sum_then_normalize", "normalize_then_sum", "sum_then_group_normalize",
                  "group_normalize_then_sum", "advantage_aggr")
GROUP_VARIANTS = ("sum_then_group_normalize", "group_normalize_then_sum")  # the modes that read `eps`
TRL_EPS = 1e-4  # TRL adds 1e-4 to every std of its multi-objective rules
FASTVIDEO_EPS = 1e-8  # DanceGRPO's and MixGRPO's scripts add 1e-8 to the group's (unbiased) std


def normalize_groups(values: torch.Tensor, group_ids: torch.Tensor | None, eps: float) -> torch.Tensor:
    """Per-group z-scores of `values` `[N]` over the finite entries (population std); NaN stays NaN."""
    groups = torch.zeros(values.shape[0], dtype=torch.long) if group_ids is None else group_ids.cpu()
    normalized = group_normalize(values, groups, eps=eps)  # [N], 0 where not finite
    return torch.where(torch.isfinite(values), normalized, torch.full_like(normalized, float("nan")))


def nanstd_unbiased(values: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """The unbiased (n - 1) standard deviation of `values` over `dim`, leaving NaN out; NaN where fewer than two values
    are not NaN (TRL's ``nanstd``)."""
    mean = torch.nanmean(values, dim=dim, keepdim=True)
    count = (~torch.isnan(values)).sum(dim=dim)
    squares = torch.nansum((values - mean) ** 2, dim=dim)
    variance = squares / (count - 1).clamp_min(1)
    return torch.where(count > 1, variance.sqrt(), torch.full_like(variance, float("nan")))


def trl_normalize_then_sum(rewards: torch.Tensor, weights: torch.Tensor,
                           group_ids: torch.Tensor | None) -> torch.Tensor:
    """TRL's ``multi_objective_aggregation="normalize_then_sum"`` advantages (see the module docstring).

    Args:
        rewards (`torch.FloatTensor` of shape `[N, K]`): each component's score; NaN: not applicable (TRL's ``None``).
        weights (`torch.FloatTensor` of shape `[K]`): the components' weights (TRL's ``reward_weights``).
        group_ids (`torch.LongTensor` of shape `[N]`, *optional*): the groups (`None`: the whole batch is one group).

    Returns:
        `torch.FloatTensor` of shape `[N]` (float64): the advantages; NaN where every component is NaN (TRL gives those
        advantage 0), 0 where the batch has fewer than two finite sums.
    """
    rewards = rewards.double()
    groups = torch.zeros(rewards.shape[0], dtype=torch.long) if group_ids is None else group_ids.cpu()
    z = torch.full_like(rewards, float("nan"))  # [N, K]
    for gid in torch.unique(groups):
        members = groups == gid
        block = rewards[members]  # [n_g, K]
        z[members] = (block - torch.nanmean(block, dim=0)) / (nanstd_unbiased(block) + TRL_EPS)
    unscorable = torch.isnan(rewards).all(dim=1)  # [N]
    summed = (z * weights.double()).nansum(dim=1)  # [N]: NaN terms count as 0
    summed[unscorable] = float("nan")
    advantages = (summed - torch.nanmean(summed)) / (nanstd_unbiased(summed) + TRL_EPS)  # [N]
    return torch.where(unscorable, summed, torch.nan_to_num(advantages, nan=0.0))


def advantage_aggr(rewards: torch.Tensor, weights: torch.Tensor, group_ids: torch.Tensor | None) -> torch.Tensor:
    """MixGRPO's ``advantage_aggr`` advantages (see the module docstring).

    Args:
        rewards (`torch.FloatTensor` of shape `[N, K]`): each component's score; NaN: not applicable (left out of its
            group's statistics and of the sum).
        weights (`torch.FloatTensor` of shape `[K]`): the components' weights.
        group_ids (`torch.LongTensor` of shape `[N]`, *optional*): the groups (`None`: the whole batch is one group).

    Returns:
        `torch.FloatTensor` of shape `[N]`: ``sum_k w_k A_k``; NaN where every component is NaN.
    """
    groups = torch.zeros(rewards.shape[0], dtype=torch.long) if group_ids is None else group_ids.cpu()
    parts = torch.stack([group_normalize(rewards[:, k].float(), groups, eps=FASTVIDEO_EPS, std="unbiased")
                         for k in range(rewards.shape[1])], dim=1)  # [N, K], 0 where not finite
    total = (parts * weights.float()).sum(dim=1)  # [N]
    unscorable = ~torch.isfinite(rewards).any(dim=1)  # [N]
    return torch.where(unscorable, torch.full_like(total, float("nan")), total)


@dataclass
class CompositeConfig:
    """Configuration of [`CompositeReward`].

    Args:
        rewards (`dict[str, dict]`): component name -> ``{name, weight, **options}`` (see the module docstring).
        normalize (`str`, defaults to `"none"`): ``"none"`` (the weighted sum), TRL's ``"sum_then_normalize"`` (the
            weighted sum, normalised by the algorithm's advantage step) or ``"normalize_then_sum"`` (per-group z-scores
            summed, then a batch z-score: the advantages themselves), or mmgrpo's per-group variants
            ``"sum_then_group_normalize"`` and ``"group_normalize_then_sum"`` (population std, `eps`), or MixGRPO's
            ``"advantage_aggr"`` (per-group advantages of each reward, summed with the weights: the advantages
            themselves). See the module docstring.
        eps (`float`, defaults to 1e-4): added to the group standard deviation of the per-group variants (TRL's rules
            use TRL's 1e-4).
    """

    rewards: dict[str, dict] = field(default_factory=dict)
    normalize: Literal["none", "sum_then_normalize", "normalize_then_sum", "sum_then_group_normalize",
                       "group_normalize_then_sum", "advantage_aggr"] = "none"
    eps: float = 1e-4

    def __post_init__(self):
        check_fields(self)
        if not self.rewards:
            raise ValueError("composite: reward.rewards is empty; name at least one reward, e.g. {format: {weight: 1.0}}.")
        check_range("eps", self.eps, 0, 1e3, low_open=True, fix="added to each reward's std; 1e-4 is usual")
        if self.eps != TRL_EPS and self.normalize not in GROUP_VARIANTS:
            raise ValueError(f"eps applies to normalize: {' / '.join(GROUP_VARIANTS)}; with {self.normalize!r} "
                             "leave it out (TRL's rules add TRL's 1e-4, advantage_aggr the authors' 1e-8).")
        self.specs = {}  # component name -> (registry name, weight, plugin Config instance); not a field
        for key, raw in self.rewards.items():
            if not isinstance(raw, dict):
                raise ValueError(f"composite: reward.rewards.{key} must be a mapping of options, got {raw!r}.")
            options = {k: v for k, v in raw.items() if k not in RESERVED}
            name = coerce(raw.get("name", key), str, f"rewards.{key}.name")
            weight = coerce(raw.get("weight", 1.0), float, f"rewards.{key}.weight")  # a finite number
            check_range(f"rewards.{key}.weight", weight, -WEIGHT_LIMIT, WEIGHT_LIMIT, fix="1.0 weighs it as the others")
            plugin = registry.get("reward", name)
            built = build_dataclass(plugin.Config, options, f"reward.rewards.{key}")
            if isinstance(built, CompositeConfig) and built.scores_are_advantages:
                raise ValueError(f"composite: reward.rewards.{key} has normalize: {built.normalize}, whose scores are "
                                 "the batch's advantages, which a sum would re-normalise: use it as the top-level "
                                 "reward, or group_normalize_then_sum inside.")
            self.specs[key] = (name, weight, built)

    @property
    def scores_are_advantages(self) -> bool:
        """Whether the group stage's scores are the advantages themselves (TRL's ``normalize_then_sum``, MixGRPO's
        ``advantage_aggr``)."""
        return self.normalize in ("normalize_then_sum", "advantage_aggr")


class CompositeReward:
    """Sums the scores of several rewards, each built from its own options."""

    Config = CompositeConfig
    modalities = frozenset()  # depends on the components; an instance holds the union of theirs
    artifacts = frozenset()  # likewise: its components' artifacts
    group_stage = None  # the class default; an instance that normalises or has group-level components holds its own

    @classmethod
    def modalities_for(cls, config: CompositeConfig) -> frozenset[str]:
        """The union of its components' modalities, each for its own options (see mmgrpo.protocols.RewardFn)."""
        return frozenset().union(*(registry.get("reward", name).modalities_for(options)
                                   for name, _, options in config.specs.values()))

    @classmethod
    def artifacts_for(cls, config: CompositeConfig) -> frozenset[str]:
        """Its components' artifacts; raises `ValueError` when two components add the same kind."""
        owners = {}
        for key, (name, _, options) in config.specs.items():
            for kind in sorted(registry.get("reward", name).artifacts_for(options)):
                if kind in owners:
                    raise ValueError(f"composite: reward.rewards.{owners[kind]} and reward.rewards.{key} both add the "
                                     f"artifact {kind!r} for the sample writers: keep it on one of them.")
                owners[kind] = key
        return frozenset(owners)

    def __init__(self, config: CompositeConfig):
        self.config = config
        self.rewards = {key: registry.get("reward", name)(options) for key, (name, _, options) in config.specs.items()}
        self.weights = {key: weight for key, (_, weight, _) in config.specs.items()}
        self.modalities = frozenset().union(*(reward.modalities for reward in self.rewards.values()))
        self.artifacts = self.artifacts_for(config)
        # the components that score against their group, in order, and the width of the features each returned
        self.staged = [key for key, reward in self.rewards.items() if reward.group_stage is not None]
        self.feature_widths: dict[str, int] | None = None  # set by __call__, read by the group stage
        if config.normalize not in ("none", "sum_then_normalize") or self.staged:
            self.group_stage = self.stage_groups  # after the gather (see the module docstring)

    def __call__(self, outputs: dict[str, Any], batch: PromptBatch) -> RewardResult:
        """Returns each sample's weighted sum `[N]` (NaN where no component applies), every component's score and
        parts, each `[N]`, the group-level components' features `[N, D_1 + D_2 + ...]` (None without any) and the
        components' artifacts; the group stage ([`stage_groups`]), if any, gives the final scores."""
        components, features, widths, artifacts = {}, [], {}, {}
        for key, reward in self.rewards.items():
            result = reward(outputs, batch)
            artifacts.update({kind: result.artifacts[kind] for kind in reward.artifacts})  # each declared kind
            components[key] = result.scores.detach().float().cpu()  # [N]
            components.update({f"{key}/{name}": value.detach().float().cpu() for name, value in result.components.items()})
            if key in self.staged:
                feature = None if result.features is None else result.features.detach().float().cpu().flatten(1)
                widths[key] = 0 if feature is None else feature.shape[1]
                if feature is not None:
                    features.append(feature)  # [N, D_key]
        self.feature_widths = widths
        total = self._weighted_sum(components)  # [N]
        components["weighted_sum"] = total
        features = torch.cat(features, dim=1) if features else None  # [N, D_1 + D_2 + ...]
        return RewardResult(scores=total, components=components, features=features, artifacts=artifacts)

    def stage_groups(self, result: RewardResult, group_ids: torch.Tensor | None) -> RewardResult:
        """The group stage: `result` of the whole batch (``scores`` `[N]`, ``components`` each `[N]`, ``features``) and
        its global `group_ids` `[N]` (`None`: one group) -> each group-level component's group stage on its slice of
        the batch, the weighted sum again, then the normalisation of `normalize` (none with ``"none"`` and
        ``"sum_then_normalize"``). Returns the scores `[N]` (with ``normalize_then_sum``: the advantages, declared by
        ``scores_are_advantages``) and the components after the stages."""
        components, summed = dict(result.components), result.scores.float()  # [N] the weighted sum before the stages
        if self.staged:
            if self.feature_widths is None:
                raise ValueError("composite: the group stage runs on the gathered results of this reward's __call__; "
                                 "call the reward on the samples first.")
            offset = 0
            for key in self.staged:
                width, prefix = self.feature_widths[key], f"{key}/"
                own = RewardResult(
                    scores=components[key],
                    components={k[len(prefix):]: v for k, v in components.items() if k.startswith(prefix)},
                    features=None if width == 0 else result.features[:, offset : offset + width],  # [N, D_key]
                )
                offset += width
                staged = self.rewards[key].group_stage(own, group_ids)
                components[key] = staged.scores.detach().float().cpu()  # [N]
                components.update({prefix + k: v.detach().float().cpu() for k, v in staged.components.items()})
            summed = components["weighted_sum"] = self._weighted_sum(components)  # [N]
        mode, eps = self.config.normalize, self.config.eps
        if mode == "normalize_then_sum":  # TRL's: the advantages of the whole batch
            rewards = torch.stack([components[k].double() for k in self.rewards], dim=1)  # [N, K]
            rewards = torch.where(torch.isfinite(rewards), rewards, torch.full_like(rewards, float("nan")))
            weights = torch.tensor([self.weights[k] for k in self.rewards], dtype=torch.float64)  # [K]
            advantages = trl_normalize_then_sum(rewards, weights, group_ids)  # [N]
            return RewardResult(scores=advantages.float(), components=components, features=result.features,
                                scores_are_advantages=True)
        if mode == "advantage_aggr":  # MixGRPO's: the advantages, group by group
            rewards = torch.stack([components[k].float() for k in self.rewards], dim=1)  # [N, K]
            weights = torch.tensor([self.weights[k] for k in self.rewards])  # [K]
            return RewardResult(scores=advantage_aggr(rewards, weights, group_ids), components=components,
                                features=result.features, scores_are_advantages=True)
        if mode == "group_normalize_then_sum":
            parts = {k: normalize_groups(components[k].float(), group_ids, eps) for k in self.rewards}
            total = _nan_sum(torch.stack([self.weights[k] * parts[k] for k in self.rewards]))  # [N]
        elif mode == "sum_then_group_normalize":
            total = normalize_groups(summed, group_ids, eps)  # [N]
        else:  # "none" and TRL's "sum_then_normalize" (the algorithm's advantage step normalises)
            total = summed
        return RewardResult(scores=total.float(), components=components, features=result.features)

    def _weighted_sum(self, components: dict[str, torch.Tensor]) -> torch.Tensor:
        """``sum_k w_k r_k`` `[N]` over the components' scores, leaving NaN terms out."""
        return _nan_sum(torch.stack([self.weights[k] * components[k] for k in self.rewards])).float()


def _nan_sum(stacked: torch.Tensor) -> torch.Tensor:
    """The sum over the first dimension of `stacked` `[K, N]` leaving out NaN terms; NaN where every term is NaN."""
    applicable = torch.isfinite(stacked).any(dim=0)  # [N]
    return torch.where(applicable, torch.nansum(stacked, dim=0), torch.full_like(stacked[0], float("nan")))


PLUGIN = CompositeReward
