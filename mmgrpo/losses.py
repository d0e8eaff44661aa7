"""Loss pieces shared by the algorithms: masked means, the clipped (PPO) surrogate, GRPO-Guard's normalised flow ratio
and Flow-DPPO's divergence mask, on plain tensors."""

from __future__ import annotations

import torch


def masked_mean(values: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Mean of `values` over the entries where `mask` is true (all entries without a mask).

    Stays connected to the graph when the mask is empty (the result is then 0 with a zero gradient), so every process
    still runs the same backward.
    """
    if mask is None:
        return values.mean()
    mask = mask.to(values.dtype)
    return (values * mask).sum() / mask.sum().clamp_min(1.0)


def clipped_objective(
    log_ratio: torch.Tensor, advantages: torch.Tensor, clip_low: float, clip_high: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's clipped objective per entry, ``max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high))`` `[n, k]`, and where
    the clip binds (the entry's gradient is 0) `[n, k]`.

    Args:
        log_ratio (`torch.FloatTensor` of shape `[n, k]`): ``log pi_new - log pi_old``.
        advantages (`torch.FloatTensor` of shape `[n]`).
    """
    ratio = torch.exp(log_ratio)  # [n, k]
    adv = advantages[:, None].to(ratio.dtype)  # [n, 1]
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    return torch.maximum(unclipped, clipped), clipped > unclipped


def k3_kl(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimate of KL(pi || ref) per entry, ``exp(d) - d - 1`` (>= 0) with ``d = ref - log_prob``
    (http://joschu.net/blog/kl-approx.html; the GRPO paper's KL term). The reference gets no gradient."""
    delta = ref_log_prob.detach() - log_prob
    return torch.exp(delta) - delta - 1


def clipped_surrogate(
    log_ratio: torch.Tensor,
    advantages: torch.Tensor,
    clip_low: float,
    clip_high: float,
    mask: torch.Tensor | None = None,
    weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO's clipped objective ``mean(max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high)))``, each entry times its
    `weight` when given (GRPO-Guard's step weight, see [`ratio_norm`]).

    Args:
        log_ratio (`torch.FloatTensor` of shape `[n, k]`): ``log pi_new - log pi_old`` per scored entry.
        advantages (`torch.FloatTensor` of shape `[n]`).
        clip_low (`float`), clip_high (`float`): the ratio is clipped to ``[1 - clip_low, 1 + clip_high]``.
        mask (`torch.BoolTensor` of shape `[n, k]`, *optional*): entries to average over.
        weight (`torch.FloatTensor` of shape `[n, k]`, *optional*): multiplies each entry's objective (no gradient).

    Returns:
        `tuple`: the loss `[]` and metrics (``policy_loss``, ``ratio_mean``, ``clip_frac``, ``approx_kl``), all over
        the masked entries.
    """
    per_entry, _ = clipped_objective(log_ratio, advantages, clip_low, clip_high)  # [n, k]
    if weight is not None:
        per_entry = per_entry * weight.detach()
    loss = masked_mean(per_entry, mask)
    if mask is not None and not bool(mask.any()):  # nothing trained here: log the on-policy values, not zeros
        return loss, {"policy_loss": 0.0, "ratio_mean": 1.0, "clip_frac": 0.0, "approx_kl": 0.0}
    with torch.no_grad():
        ratio = torch.exp(log_ratio)  # [n, k]
        clipped = ((ratio < 1 - clip_low) | (ratio > 1 + clip_high)).float()
        metrics = {
            "policy_loss": loss.item(),
            "ratio_mean": masked_mean(ratio, mask).item(),
            "clip_frac": masked_mean(clipped, mask).item(),
            "approx_kl": masked_mean(0.5 * log_ratio**2, mask).item(),
        }
    return loss, metrics


def gaussian_mean_kl(mean: torch.Tensor, ref_mean: torch.Tensor, std: torch.Tensor,
                     mask: torch.Tensor | None = None) -> torch.Tensor:
    """``(mean - ref_mean)^2 / (2 std^2)`` averaged over the elements of the transitions `mask` marks (all without
    one): the KL between two Gaussians of std `std` when `std` is the transition's, Flow-GRPO's term when it is
    ``sigma_t``. Entries with std 0 (deterministic transitions, placeholders) contribute nothing.

    Args:
        mean (`torch.FloatTensor` of shape `[n, k, ...]`), ref_mean (`torch.FloatTensor` of shape `[n, k, ...]`): the
            transitions' means under the policy and the reference (no gradient).
        std (`torch.FloatTensor` of shape `[n, k, 1, ...]`).
        mask (`torch.BoolTensor` of shape `[n, k]`, *optional*): the transitions to average over.
    """
    safe = torch.where(std > 0, std, torch.ones_like(std))
    kl = (mean - ref_mean.detach()) ** 2 / (2 * safe**2)
    kl = torch.where(std > 0, kl, torch.zeros_like(kl))  # [n, k, ...]
    if mask is None:
        return kl.mean()
    per_transition = kl.flatten(2).mean(-1)  # [n, k]
    return masked_mean(per_transition, mask)


def _per_transition(value: torch.Tensor) -> torch.Tensor:
    """A per-transition scalar stored broadcastable to the latents, `[n, k, 1, ...]` -> `[n, k]`."""
    return value.reshape(*value.shape[:2], -1)[..., 0]


def ratio_norm(
    log_ratio: torch.Tensor,
    mean: torch.Tensor,
    old_mean: torch.Tensor,
    std: torch.Tensor,
    noise_scale: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO-Guard's RatioNorm (https://arxiv.org/abs/2510.22319) of the log-ratio of Gaussian flow-SDE transitions, and
    each transition's step length ``|dt|``, whose inverse is GRPO-Guard's loss weight of the step.

    With ``s = sigma_t sqrt(|dt|)`` the transition std and ``d = mu_theta - mu_old``, the normalised log-ratio is
    ``(log_ratio + mean(d^2) / (2 s^2)) * s``. Since ``x' = mu_old + s eps``, the log-ratio of two Gaussians of std `s`
    is ``mean(eps d) / s - mean(d^2) / (2 s^2)``: the added term removes its negative mean (the per-step bias), the
    factor `s` its dependence on the noise level, leaving ``mean(eps d)``. ``|dt| = (s / sigma_t)^2``.

    Args:
        log_ratio (`torch.FloatTensor` of shape `[n, k]`): ``log pi_theta - log pi_old`` (element-mean log-densities).
        mean (`torch.FloatTensor` of shape `[n, k, ...]`): the transitions' means under the policy (with gradients).
        old_mean (`torch.FloatTensor` of shape `[n, k, ...]`): their means under the sampling policy.
        std (`torch.FloatTensor` of shape `[n, k, 1, ...]`): the transition std `s` (0 on placeholders).
        noise_scale (`torch.FloatTensor` of shape `[n, k, 1, ...]`): ``sigma_t`` (Flow-GRPO's ``std_dev_t``).

    Returns:
        `tuple`: the normalised log-ratio `[n, k]` and ``|dt|`` `[n, k]` (1 on placeholders, where both are
        meaningless and the log-ratio is 0).
    """
    s = _per_transition(std).to(log_ratio.dtype)  # [n, k]
    scale = _per_transition(noise_scale).to(log_ratio.dtype)  # [n, k]
    real = s > 0
    safe_s = torch.where(real, s, torch.ones_like(s))
    shift = (mean - old_mean.detach()).pow(2).flatten(2).mean(-1)  # [n, k]
    normed = (log_ratio + shift / (2 * safe_s**2)) * safe_s
    dt = torch.where(real & (scale > 0), (s / torch.where(scale > 0, scale, torch.ones_like(scale))) ** 2,
                     torch.ones_like(s))
    return torch.where(real, normed, torch.zeros_like(normed)), dt


def transition_kl(mean: torch.Tensor, other_mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """``mean((mean - other_mean)^2 / (2 std^2))`` over each transition's elements, `[n, k]`: the KL between two
    Gaussian transitions of std `std` (0 where `std` is 0: placeholders, deterministic steps).

    Args:
        mean (`torch.FloatTensor` of shape `[n, k, ...]`), other_mean (`torch.FloatTensor` of shape `[n, k, ...]`).
        std (`torch.FloatTensor` of shape `[n, k, 1, ...]`): broadcastable to `mean`.
    """
    safe = torch.where(std > 0, std, torch.ones_like(std))
    kl = (mean - other_mean) ** 2 / (2 * safe**2)
    kl = torch.where(std > 0, kl, torch.zeros_like(kl))  # [n, k, ...]
    return kl.flatten(2).mean(-1)


def divergence_masked_objective(
    log_ratio: torch.Tensor, advantages: torch.Tensor, kl: torch.Tensor, threshold: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Flow-DPPO's objective per entry, ``-A r`` where kept, 0 where masked, `[n, k]`, and the mask `[n, k]`: an entry
    is masked when its transition's KL to the sampling policy is at least `threshold` *and* the update moves it further
    away (``r > 1`` with ``A > 0``, or ``r < 1`` with ``A < 0``); corrective updates stay.

    Args:
        log_ratio (`torch.FloatTensor` of shape `[n, k]`), advantages (`torch.FloatTensor` of shape `[n]`).
        kl (`torch.FloatTensor` of shape `[n, k]`): each transition's KL to the sampling policy (no gradient needed).
    """
    ratio = torch.exp(log_ratio)  # [n, k]
    adv = advantages[:, None].to(ratio.dtype).expand_as(ratio)  # [n, k]
    outside = kl.detach() >= threshold
    masked = outside & (((ratio > 1) & (adv > 0)) | ((ratio < 1) & (adv < 0)))
    unclipped = -adv * ratio
    return torch.where(masked.detach(), torch.zeros_like(unclipped), unclipped), masked
