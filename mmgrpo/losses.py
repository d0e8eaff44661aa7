"""Loss pieces shared by the algorithms: masked means and the clipped (PPO) surrogate on plain tensors."""

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
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO's clipped objective ``mean(max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high)))``.

    Args:
        log_ratio (`torch.FloatTensor` of shape `[n, k]`): ``log pi_new - log pi_old`` per scored entry.
        advantages (`torch.FloatTensor` of shape `[n]`).
        clip_low (`float`), clip_high (`float`): the ratio is clipped to ``[1 - clip_low, 1 + clip_high]``.
        mask (`torch.BoolTensor` of shape `[n, k]`, *optional*): entries to average over.

    Returns:
        `tuple`: the loss `[]` and metrics (``policy_loss``, ``ratio_mean``, ``clip_frac``, ``approx_kl``), all over
        the masked entries.
    """
    per_entry, _ = clipped_objective(log_ratio, advantages, clip_low, clip_high)  # [n, k]
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
