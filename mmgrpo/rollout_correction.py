"""Rollout correction: training on rollouts whose engine reports log-probs that differ from the trainer's forward of
the same weights (vLLM / SGLang kernels, bf16), as TRL's vLLM importance-sampling correction and verl's rollout
correction do. The options are [`~mmgrpo.algorithms._options.RolloutCorrectionOptions`], embedded in the token
algorithms that apply them (`grpo`, `dr_grpo`, `dapo`).

With ``pi_rollout`` the engine's log-probs of the sampled tokens (``Rollout.engine_log_probs``) and ``pi_old`` the
trainer's, recomputed here before any update of the step (no gradient), ``rho = pi_old / pi_rollout``:

- the rollout's ``old_log_probs`` become ``pi_old`` (the PPO ratio is ``pi_theta / pi_old``: verl's decoupled mode,
  TRL's recomputed ``old_per_token_logps``);
- truncated / masked importance sampling: ``Rollout.is_weights`` `[N, S]` (TRL's rule, per token or per sequence with
  ``rho_seq = exp(sum_t log rho_t)``), which the loss multiplies into each token's policy term;
- rejection (verl's ``rollout_rs``): tokens or sequences whose ratio (token, product, or geometric mean
  ``exp(mean_t log rho_t)``) is outside the bounds leave ``Rollout.mask``, so no normaliser counts them.

Logged every step (``rollout_corr/*``, this process's tokens): ``kl`` and ``k3_kl``, the k1 and k3 estimates of
KL(pi_rollout || pi_old) on the sampled tokens; the quantiles 0.05 / 0.5 / 0.95, min and max of the token ratio
``rho``; ``logp_diff_mean`` / ``logp_diff_max`` of ``|log pi_old - log pi_rollout|`` (TRL's
``sampling_logp_difference``); ``weight_mean`` of the weights over the trained tokens; ``dropped_share``, the share of
trained tokens given weight 0 or rejected.

Differences from the peers: TRL always recomputes with vLLM and has no rejection modes; verl's safety bound of the
log-ratio at +-20 is not applied to the truncate / mask weights (TRL applies none), nor its batch normalisation and
per-token veto (not implemented).
"""

from __future__ import annotations

import dataclasses
import math

import torch

from .preflight import SCORERS
from .types import Rollout


def correction(old: torch.Tensor, engine: torch.Tensor, mask: torch.Tensor, options) -> tuple:
    """The importance weights and the kept tokens of one batch under `options` (a
    [`~mmgrpo.algorithms._options.RolloutCorrectionOptions`]).

    Args:
        old (`torch.FloatTensor` of shape `[N, S]`): the trainer's log-probs of the sampled tokens, ``log pi_old``.
        engine (`torch.FloatTensor` of shape `[N, S]`): the engine's, ``log pi_rollout``.
        mask (`torch.BoolTensor` of shape `[N, S]`): the trained tokens.

    Returns:
        `tuple`: the weights `[N, S]` (0 off `mask`; `None` when the mode weighs nothing) and the kept tokens `[N, S]`.
    """
    log_rho = (old - engine).masked_fill(~mask, 0.0)  # [N, S]
    mode = options.rollout_correction
    if mode == "recompute":
        return None, mask
    level, kind = mode.split("_")
    if kind == "reject":
        lower, upper = options.reject_bounds
        stat = log_rho if level == "token" else log_rho.sum(dim=1, keepdim=True)  # [N, S] or [N, 1]
        if level == "geometric":
            stat = stat / mask.sum(dim=1, keepdim=True).clamp_min(1)
        outside = (stat > math.log(upper)) | (stat < math.log(lower))
        return None, mask & ~outside
    rho = torch.exp(log_rho if level == "token" else log_rho.sum(dim=1, keepdim=True))  # [N, S] or [N, 1]
    low, high = options.rollout_is_clip_min, options.rollout_is_clip_max
    if kind == "truncate":
        weights = rho if low is None and high is None else torch.clamp(rho, min=low, max=high)
    else:  # mask: 0 outside the bounds
        outside = (rho < (-math.inf if low is None else low)) | (rho > (math.inf if high is None else high))
        weights = rho.masked_fill(outside, 0.0)
    return weights.expand_as(log_rho) * mask, mask


def mismatch_metrics(old: torch.Tensor, engine: torch.Tensor, mask: torch.Tensor, weights: torch.Tensor | None,
                     kept: torch.Tensor) -> dict[str, float]:
    """The ``rollout_corr/*`` metrics of the module docstring over the trained tokens `mask` `[N, S]`."""
    if not mask.any():
        return {}
    log_rho = (old - engine)[mask]  # [tokens]
    rho = torch.exp(log_rho)
    q05, q50, q95 = torch.quantile(rho.double(), torch.tensor([0.05, 0.5, 0.95], dtype=torch.float64)).tolist()
    dropped = (mask & ~kept) | (mask & (weights == 0)) if weights is not None else mask & ~kept
    return {
        "rollout_corr/kl": float((-log_rho).mean()),
        "rollout_corr/k3_kl": float((rho - 1 - log_rho).mean()),
        "rollout_corr/ratio_q05": q05, "rollout_corr/ratio_q50": q50, "rollout_corr/ratio_q95": q95,
        "rollout_corr/ratio_min": float(rho.min()), "rollout_corr/ratio_max": float(rho.max()),
        "rollout_corr/logp_diff_mean": float(log_rho.abs().mean()),
        "rollout_corr/logp_diff_max": float(log_rho.abs().max()),
        "rollout_corr/weight_mean": float(weights[mask].mean()) if weights is not None else 1.0,
        "rollout_corr/dropped_share": float(dropped.sum() / mask.sum()),
    }


@torch.no_grad()
def recompute_old(rollout: Rollout, policy, algorithm, units: list[list[int]], minibatch_size: int) -> torch.Tensor:
    """The trainer's log-probs `[N, S]` of the rollout's sampled transitions at the plan's `units` (the engine's
    elsewhere), scored as the algorithm scores (``policy.log_prob``), `minibatch_size` samples at a time."""
    score = SCORERS[algorithm.scoring](policy)
    old = rollout.engine_log_probs.clone().float()  # [N, S]
    for unit in units:
        for index in torch.arange(len(rollout)).split(minibatch_size):
            old[index[:, None], torch.as_tensor(unit)] = score(rollout.select(index), unit).log_prob.float().cpu()
    return old


def correct_rollout(rollout: Rollout, policy, algorithm, units: list[list[int]],
                    minibatch_size: int) -> tuple[Rollout, dict[str, float]]:
    """`rollout` ready for the update, and the mismatch metrics: unchanged without engine log-probs; otherwise its old
    log-probs recomputed by the trainer, its weights and kept tokens under the algorithm's
    ``traits.rollout_correction`` (see the module docstring)."""
    if rollout.engine_log_probs is None:
        return rollout, {}
    options = algorithm.traits.rollout_correction
    if options is None:
        raise ValueError(f"The rollout comes from an engine whose log-probs differ from the trainer's, and algorithm "
                         f"{type(algorithm).__name__} applies no rollout correction: use grpo, dr_grpo or dapo "
                         "(algorithm.rollout_correction), or the local engine.")
    old = recompute_old(rollout, policy, algorithm, units, minibatch_size)  # [N, S]
    engine = rollout.engine_log_probs.float()
    weights, kept = correction(old, engine, rollout.mask, options)
    metrics = mismatch_metrics(old, engine, rollout.mask, weights, kept)
    return dataclasses.replace(rollout, old_log_probs=old, mask=kept, is_weights=weights), metrics
