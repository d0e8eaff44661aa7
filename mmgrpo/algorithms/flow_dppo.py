"""Flow-DPPO: Flow-GRPO's rollout and per-step ratio, with a divergence trust region instead of the ratio clip.

Paper: https://arxiv.org/abs/2606.11025 (code: Tencent-Hunyuan/UniRL, ``unirl/algorithms/flowdppo.py``; verl-omni's
``flow_dppo`` loss). Each trained SDE transition is Gaussian; its KL to the sampling (old) step distribution is

    KL_t = mean((mu_theta - mu_old)^2 / (2 s^2)),   s = sigma_t sqrt(|dt|)  (or s = 1 without the coefficient),

averaged over the latent's elements. With ``r = exp(log pi_theta - log pi_old)``, the loss of a step is

    L = mean(-A r * (1 - M)),   M = [KL_t >= kl_mask_threshold] and ([r > 1 and A > 0] or [r < 1 and A < 0]):

no clip; an update is dropped only when the transition is outside the trust region *and* the update moves it further
away; corrective updates stay. An optional KL to the reference (``kl_beta``, off as the authors') is the exact
transition KL, as `flow_grpo`'s ``kl_convention: transition`` (UniRL's ``beta`` term).

The sampling plan is Flow-GRPO's ([`~mmgrpo.algorithms.flow_grpo.window_plan`]: every step SDE, or Flow-GRPO-Fast's
window), with feature ``"old_mean"``: the rollout records the mean ``mu_old`` of every trained transition.

Differences from the authors' code: UniRL replays the old means (and, with ``old_logp_source: replay``, the old
log-probs) at the pre-update weights before the updates of a batch; we record them at sampling, which is the same
policy (equal up to the float differences between the sampling and the replay forward). UniRL replays all the SDE
steps of a sample in one call and averages the loss over (sample, step); our trainer scores one step per unit and
averages the units, the same mean when every sample trains every step. Advantages are Flow-GRPO's (the group's
population std + 1e-4, clamped to ``[-5, 5]``), as `flow_grpo`; UniRL's SD3.5 recipe divides the group-centred rewards
by the whole batch's std and clamps nothing (``scale_rewards: batch``, ``adv_clip_max: null`` here).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..losses import divergence_masked_objective, masked_mean, transition_kl
from ..plans import FlowPlan
from ..types import AlgorithmTraits, LossOutput, Score
from ..validation import ConfigError, check_fields, check_range, embedded
from . import _options
from ._limits import SCALE_LIMIT
from ._options import AdvantageOptions, KLOptions, KLWeight, SDEOptions
from .flow_grpo import check_window, window_plan


@dataclass
class FlowDPPOConfig:
    """Options of [`FlowDPPO`]: its own and the shared advantage, KL and SDE options (written flat, see
    ``mmgrpo show flow_dppo``) with the authors' defaults.

    Args:
        kl_mask_threshold (`float`): the trust region's bound on each transition's KL to the sampling step
            (UniRL: 1e-5); an update of a transition at or beyond it that moves it further away is masked.
        add_kl_coefficient (`bool`): divide the mean drift by the transition std ``sigma_t sqrt(|dt|)`` (the exact
            Gaussian KL, UniRL's default); false: by 1 (the raw ``mean((mu_theta - mu_old)^2) / 2``).
        adv_std (`str`), adv_eps (`float`), adv_clip_max (`float`, *optional*): Flow-GRPO's advantages (population
            std + 1e-4, clamped to ``[-5, 5]``).
        kl_beta (`float`): weight of the exact transition KL to the reference policy (UniRL's ``beta``; 0: off, no
            reference forward).
        noise_level (`float`), sde_type (`str`): the SDE steps (``"sde"``: the KL needs the Gaussian transition).
        sde_window_size (`int`): Flow-GRPO-Fast: number of consecutive SDE (and trained) steps (0: every step SDE).
        sde_window_range (`list[int]`, *optional*): ``[lo, hi)`` range of the window start (default: the first half).
        timestep_fraction (`float`): without a window, the first ``int(num_steps * fraction)`` steps are trained.
    """

    kl_mask_threshold: float = 1e-5
    add_kl_coefficient: bool = True
    advantage: AdvantageOptions = embedded(AdvantageOptions, scale_rewards="group", adv_std="population",
                                           adv_eps=1e-4, adv_clip_max=5.0)
    kl: KLOptions = embedded(KLOptions, kl_beta=0.0)
    sde: SDEOptions = embedded(SDEOptions, noise_level=0.7)
    sde_window_size: int = 0
    sde_window_range: list[int] | None = None
    timestep_fraction: float = 1.0

    def __post_init__(self):
        check_fields(self)
        check_range("kl_mask_threshold", self.kl_mask_threshold, 0, SCALE_LIMIT, low_open=True,
                    fix="the authors' bound is 1e-5 (a KL per latent element, in nats)")
        if self.sde.sde_type != "sde":
            raise ConfigError(f"flow_dppo's trust region is the KL of Gaussian SDE transitions; sde_type "
                              f"{self.sde.sde_type!r} scores another quantity: use sde_type: sde.")
        check_window(self)


class FlowDPPO:
    """Flow-DPPO: group-normalised advantages, per-step ratio, updates masked outside a KL trust region."""

    Config = FlowDPPOConfig
    scoring = "trajectory"
    plan_family = "flow"  # the plan type `schedule` returns
    advantages = _options.advantages  # the shared advantage options

    def __init__(self, config: FlowDPPOConfig):
        self.config = config
        self.kl = KLWeight(config.kl)  # the KL weight to the reference, moving under a schedule
        self.traits = AlgorithmTraits(reads=frozenset({"log_prob", "mean", "old_mean", "std"}),
                                      needs_reference=self.kl.ever_positive,
                                      group_local_advantages=config.advantage.group_local)

    def schedule(self, num_steps: int, generator: torch.Generator | None = None) -> FlowPlan:
        """Flow-GRPO's plan (all steps SDE, or a random window), recording the trained transitions' means."""
        return window_plan(self.config, num_steps, generator, record_mean=True)

    def loss(self, new: Score, old_log_prob, advantages, ref: Score | None = None) -> LossOutput:
        """The divergence-masked policy gradient on one unit of steps, plus the KL term.

        Args:
            new ([`Score`]): ``log_prob`` `[n, k]`, ``mean`` and ``old_mean`` `[n, k, ...]`, ``std`` `[n, k, 1, ...]`.
            old_log_prob (`torch.FloatTensor` of shape `[n, k]`): log-probs recorded at sampling.
            advantages (`torch.FloatTensor` of shape `[n]`).
            ref ([`Score`], *optional*): the reference policy's ``mean`` for the KL term.
        """
        log_ratio = new.log_prob - old_log_prob  # [n, k]
        scale = new.std if self.config.add_kl_coefficient else (new.std > 0).to(new.std.dtype)  # [n, k, 1, ...]
        with torch.no_grad():
            divergence = transition_kl(new.mean, new.old_mean, scale)  # [n, k]
        bound = self.config.kl_mask_threshold
        per_entry, masked = divergence_masked_objective(log_ratio, advantages, divergence, bound)  # [n, k], [n, k]
        loss = masked_mean(per_entry, new.mask)
        with torch.no_grad():
            ratio = torch.exp(log_ratio)  # [n, k]
            metrics = {
                "policy_loss": loss.item(),
                "ratio_mean": masked_mean(ratio, new.mask).item(),
                "approx_kl": masked_mean(0.5 * log_ratio**2, new.mask).item(),
                "kl_old_mean": masked_mean(divergence, new.mask).item(),
                "kl_mask_frac": masked_mean((divergence >= bound).float(), new.mask).item(),
                "masked_frac": masked_mean(masked.float(), new.mask).item(),
            }
        loss = self.kl.add_transition_kl(loss, metrics, new, ref)
        return LossOutput(loss=loss, metrics=metrics)


PLUGIN = FlowDPPO
