"""Group-relative advantage estimators shared by the algorithms."""

from __future__ import annotations

import math
from typing import Literal

import torch

StdEstimator = Literal["population", "unbiased"]
STD_ESTIMATORS = ("population", "unbiased")
REWARD_SCALINGS = ("group", "batch", "none")


def group_normalize(
    scores: torch.Tensor,
    group_ids: torch.Tensor,
    *,
    scale: Literal["group", "batch", "none"] = "group",
    eps: float = 1e-4,
    clip: float | None = None,
    std: StdEstimator = "population",
) -> torch.Tensor:
    """Advantages ``(r - mean_group) / (std_group + eps)`` keyed by explicit group ids.

    Args:
        scores (`torch.FloatTensor` of shape `[N]`): rewards gathered from every process; NaN or infinite means
            "not applicable": such samples are left out of the statistics and get advantage 0 (the trainer does not
            score them at all, see the skip rules of `mmgrpo.trainer`). A group whose valid scores are all equal gets
            exactly 0.
        group_ids (`torch.LongTensor` of shape `[N]`): group of each sample.
        scale (`str`): the standard deviation the centred scores are divided by: ``"group"``, the group's;
            ``"batch"``, that of all valid scores (the mean stays the group's); ``"none"``, none (mean-centring only,
            as Dr. GRPO).
        eps (`float`): added to the standard deviation.
        clip (`float`, *optional*): clamp advantages to ``[-clip, clip]``.
        std (`str`): the standard deviation's estimator: ``"population"`` divides the squared deviations by `n`
            (NumPy's default: Flow-GRPO, DGPO), ``"unbiased"`` by ``n - 1`` (Bessel; PyTorch's default: TRL, GCPO,
            VisualGRPO). At `n` = 2 the unbiased std is sqrt(2) times the population one.

    Returns:
        `torch.FloatTensor` of shape `[N]`.
    """
    if std not in STD_ESTIMATORS:
        raise ValueError(f"std must be 'population' or 'unbiased', got {std!r}.")
    if scale not in REWARD_SCALINGS:
        raise ValueError(f"scale must be 'group', 'batch' or 'none', got {scale!r}.")
    unbiased = std == "unbiased"
    scores = scores.float()
    valid = torch.isfinite(scores)
    advantages = torch.zeros_like(scores)
    global_scale = scores[valid].std(unbiased=unbiased) if scale == "batch" and valid.sum() > 1 else None
    for gid in torch.unique(group_ids):
        members = (group_ids == gid) & valid
        if members.sum() == 0:
            continue
        group = scores[members]
        if bool((group == group[0]).all()):
            continue  # identical rewards: exactly 0 (a mean's rounding error over eps would not be)
        centred = group - group.mean()
        if scale != "none":
            scale_by = global_scale if global_scale is not None else group.std(unbiased=unbiased)
            centred = centred / (scale_by + eps)
        advantages[members] = centred
    if clip is not None:
        advantages = advantages.clamp(-clip, clip)
    return advantages  # [N]


def reward_advantages(algorithm, result, group_ids: torch.Tensor, member_ids: torch.Tensor | None = None,
                      plan=None, log_probs: torch.Tensor | None = None) -> torch.Tensor:
    """The advantages of a gathered reward `result` ([`~mmgrpo.types.RewardResult`], after its group stage):
    ``algorithm.advantages(result.scores, group_ids)`` `[N]`, or, for an algorithm declaring
    ``traits.step_advantages``, ``algorithm.step_advantages(result.scores, group_ids, member_ids, plan, log_probs)``
    `[N, S]` (`member_ids` `[N]`: each sample's index in its group; `plan` the step's sampling plan; `log_probs`
    `[N, S]`: the rollout's recorded ``old_log_probs`` of the same samples, or None). When the result declares
    ``scores_are_advantages`` (its group stage ended in the advantage step, e.g. TRL's ``normalize_then_sum``), its
    scores as they are, NaN as 0 (such a sample is not scored, see the trainer's skip rules). Either way an algorithm
    declaring ``traits.selects_samples`` then keeps its selection: ``algorithm.select_samples(advantages, group_ids)``
    (DanceGRPO's best-of-N)."""
    scores = result.scores.float()  # [N]
    if result.scores_are_advantages:
        if algorithm is not None and algorithm.traits.step_advantages:
            raise ValueError("The reward's scores are already the advantages (composite normalize_then_sum), but the "
                             "algorithm computes an advantage per step from the rewards: use group_normalize_then_sum.")
        advantages = torch.where(torch.isfinite(scores), scores, torch.zeros_like(scores))  # [N]
    elif algorithm.traits.step_advantages:
        if member_ids is None or plan is None:
            raise ValueError("An algorithm with per-step advantages needs the samples' member ids and the plan.")
        return algorithm.step_advantages(scores, group_ids, member_ids, plan, log_probs)  # [N, S]
    else:
        advantages = algorithm.advantages(scores, group_ids)  # [N]
    if algorithm is not None and algorithm.traits.selects_samples:
        advantages = algorithm.select_samples(advantages, group_ids)  # [N]
    return advantages


def sample_signal(advantages: torch.Tensor) -> torch.Tensor:
    """Which samples have a non-zero advantage: `[N]` or per step `[N, S]` (any step) -> `[N]` bool. A NaN step
    advantage (`[N, S]`: a transition left untrained, BranchGRPO's width pruning) is no signal; a NaN sample advantage
    (`[N]`) is signal, so the step's loss turns non-finite and the update is skipped."""
    signal = advantages != 0
    if advantages.dim() > 1:
        signal &= ~torch.isnan(advantages)
    return signal.reshape(len(advantages), -1).any(dim=1)


def groups_with_signal(advantages: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """Which samples belong to a group with at least one non-zero advantage.

    Args:
        advantages (`torch.FloatTensor` of shape `[N]` or `[N, S]`): advantages of the whole (gathered) batch, per
            sample or per sample and step.
        group_ids (`torch.LongTensor` of shape `[N]`): group of each sample.

    Returns:
        `torch.BoolTensor` of shape `[N]`: `False` for every member of a group whose advantages are all exactly 0.
    """
    _, inverse = torch.unique(group_ids, return_inverse=True)
    signal = torch.zeros(int(inverse.max()) + 1, dtype=torch.bool).index_put_(
        (inverse,), sample_signal(advantages), accumulate=True
    )  # [groups]
    return signal[inverse]  # [N]


def tempsamp_soft(scores: torch.Tensor, threshold: float = 0.8, alpha_high: float = 0.01,
                  alpha_low: float = 1.0) -> torch.Tensor:
    """TempSamp-R1's asymmetric soft transform of rewards, applied before the group statistics ("soft advantage").

    Paper: TempSamp-R1, https://arxiv.org/abs/2509.18056. With ``tau`` = `threshold`::

        r >= tau:  tau + alpha_high * log(r - tau + 1)                       (above the threshold: nearly flat)
        r <  tau:  tau - (exp(alpha_low * (tau - r)) - 1) / (exp(alpha_low) - 1)   (below: steeper the further)

    The map is continuous and increasing; at ``r = tau - 1`` it gives ``tau - 1``. Non-finite scores stay non-finite
    (not applicable), as does a reward so far below ``tau`` that the exponential overflows.

    Args:
        scores (`torch.FloatTensor` of shape `[N]`): rewards (NaN: not applicable).
        threshold (`float`): ``tau``.
        alpha_high (`float`): slope of the log branch (>= 0).
        alpha_low (`float`): curvature of the exponential branch (> 0).

    Returns:
        `torch.FloatTensor` of shape `[N]`.
    """
    r = scores.float()
    above = threshold + alpha_high * torch.log1p((r - threshold).clamp_min(0))  # [N]
    below = threshold - torch.expm1(alpha_low * (threshold - r).clamp_min(0)) / math.expm1(alpha_low)  # [N]
    return torch.where(r >= threshold, above, below)  # NaN compares false: `below` keeps it NaN


def kept_samples(advantages: torch.Tensor, parts: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """Flow-GRPO's filter of zero advantages on one process's samples (``traits.drop_zero_advantage``): the indices of
    the samples to train, to be cut into `parts` minibatches of equal size.

    The samples whose advantage is exactly 0 are dropped. When the kept count is not a multiple of `parts`, dropped
    samples drawn at random (``torch.randperm`` with `generator`) are put back until it is, as far as there are dropped
    samples; when none is kept, all are (the authors' Wan script then trains every sample).

    Args:
        advantages (`torch.FloatTensor` of shape `[n]` or `[n, S]`): this process's advantages (per step: a sample is
            dropped when all its steps' are 0).
        parts (`int`): the number of minibatches the kept samples are cut into.

    Returns:
        `torch.LongTensor` of shape `[k]`: the kept indices, increasing.
    """
    keep = sample_signal(advantages)  # [n]
    if not keep.any():
        return torch.arange(len(advantages))
    dropped = torch.nonzero(~keep).flatten()  # [n - k]
    short = -int(keep.sum()) % parts
    back = dropped[torch.randperm(len(dropped), generator=generator)[:short]] if short else dropped[:0]
    keep[back] = True
    return torch.nonzero(keep).flatten()  # [k]
