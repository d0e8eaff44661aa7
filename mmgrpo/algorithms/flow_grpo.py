"""Flow-GRPO: clipped per-step policy gradient through the SDE steps of a flow-matching sampler.

Paper: https://arxiv.org/abs/2505.05470 (Flow-GRPO-Fast: SDE on a window of steps, ODE elsewhere; code:
yifan123/flow_grpo). Advantages as the authors' code: ``(r - mean_group) / (std + 1e-4)`` with NumPy's (population)
std, of the group or, with ``scale_rewards: batch`` (the authors' ``global_std: true``), of the whole batch, clamped to
``[-5, 5]``. The loss of a step is the clipped surrogate of [`~mmgrpo.losses.clipped_surrogate`], plus the KL term.

With `drop_zero_advantage` (the authors' code, always on there), each process leaves its samples whose advantage is
exactly 0 (all-equal groups) out of its batch before cutting it into minibatches: the minibatches shrink, their number
stays, so the loss averages over the kept samples only (with half the groups flat, twice the gradient of keeping
them), and they add no KL either. When the kept count does not split evenly, dropped samples drawn at random are put
back until it does; a process that keeps none keeps them all (the authors' Wan script). See the trainer's
``traits.drop_zero_advantage``.

GRPO-Guard (https://arxiv.org/abs/2510.22319; code: the GRPO-Guard scripts of yifan123/flow_grpo, verl-omni's
``grpo_guard`` loss, Flow-Factory's ``GRPOGuardTrainer``) is the option ``ratio_norm: true`` (default off): with ``s =
sigma_t sqrt(|dt|)`` the step's transition std and the rollout's recorded transition mean ``mu_old``,

    r = exp(s (log pi_theta - log pi_old) + mean(|mu_theta - mu_old|^2) / (2 s)),
    L_step = mean(max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high))) / |dt|,

see [`~mmgrpo.losses.ratio_norm`]. Differences: the authors take ``s`` and ``|dt|`` as means over the batch, equal to
ours since every sample of a step shares them; Flow-Factory's trainer computes this ratio and then overwrites it with
the plain ``exp(log pi_theta - log pi_old)`` before the loss (and has no ``1 / |dt|``), so its published run is plain
Flow-GRPO: we follow the authors' flow_grpo scripts and verl-omni, which use it. The authors' GRPO-Guard configs pair it
with a much smaller clip (verl-omni: 2e-6); the clip stays an option here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from ..losses import clipped_surrogate, gaussian_mean_kl
from ..plans import FlowPlan
from ..types import AlgorithmTraits, LossOutput, Score
from ..validation import check_fields, check_range, embedded
from ._limits import STEP_LIMIT
from . import _options
from ._options import AdvantageOptions, ClipOptions, KLOptions, KLWeight, RatioOptions, SDEOptions


@dataclass
class FlowGRPOConfig:
    """Options of [`FlowGRPO`]: its own and the shared clip, KL and advantage options (written flat, see
    ``mmgrpo show flow_grpo``) with the authors' defaults.

    Args:
        clip_low (`float`): the per-step ratio is clipped to ``[1 - clip_low,
            1 + clip_high]`` (Flow-GRPO: 1e-4, symmetric; 1e-5 for Fast / CPS).
        adv_std (`str`): the std estimator of the advantages, ``"population"`` (n, Flow-GRPO's) or ``"unbiased"``.
        adv_clip_max (`float`, *optional*): advantages are clamped to ``[-adv_clip_max, adv_clip_max]`` (5).
        kl_beta (`float`): weight of the KL to the reference policy (0 disables the reference forward).
        kl_convention (`str`): what `kl_beta` multiplies, per element of a transition's mean, averaged:

            - ``"transition"``: the exact KL of the two Gaussian transitions,
              ``(mu - mu_ref)^2 / (2 sigma_t^2 |dt|)`` (``std = sigma_t sqrt(|dt|)``);
            - ``"flow_grpo"``: Flow-GRPO's published code, ``(mu - mu_ref)^2 / (2 sigma_t^2)``, which is
              ``"transition"`` times ``|dt|``: at 10 steps about 10x weaker for one beta. The authors' betas
              (0.04 GenEval / OCR, 0.01 PickScore, 0.004 Wan) mean what they mean there only with this convention.
              For CPS both divide by the transition std (the two conventions agree).
        drop_zero_advantage (`bool`): the authors' filter of samples with advantage exactly 0 (see the module
            docstring); false keeps them in the minibatch mean with a zero policy gradient.
        sde_window_size (`int`): Flow-GRPO-Fast: number of consecutive SDE steps (0: every step is SDE).
        sde_window_range (`list[int]`, *optional*): ``[lo, hi)`` range of the window start (default: the first
            half of the steps).
        timestep_fraction (`float`): without a window, the first ``int(num_steps * fraction)`` steps are trained.
        ratio_norm (`bool`): GRPO-Guard's RatioNorm and step reweight (see the module docstring; off: Flow-GRPO).
    """

    clip: ClipOptions = embedded(ClipOptions, clip_low=1e-4)
    advantage: AdvantageOptions = embedded(AdvantageOptions, scale_rewards="group", adv_std="population",
                                           adv_eps=1e-4, adv_clip_max=5.0)
    kl: KLOptions = embedded(KLOptions, kl_beta=0.0)
    kl_convention: Literal["transition", "flow_grpo"] = "transition"
    drop_zero_advantage: bool = True
    sde: SDEOptions = embedded(SDEOptions, noise_level=0.7)
    sde_window_size: int = 0
    sde_window_range: list[int] | None = None
    timestep_fraction: float = 1.0
    ratio: RatioOptions = embedded(RatioOptions)

    def __post_init__(self):
        check_fields(self)
        self.ratio.check_sde(self.sde)
        check_window(self)


def check_window(c) -> None:
    """Validates the SDE window options of a config with Flow-GRPO's `sde_window_size`, `sde_window_range` and
    `timestep_fraction` (shared with `flow_dppo`)."""
    check_range("sde_window_size", c.sde_window_size, 0, STEP_LIMIT, fix="0: every step is an SDE step")
    check_range("timestep_fraction", c.timestep_fraction, 0, 1, low_open=True,
                fix="the first int(num_steps * fraction) steps are trained")
    if c.sde_window_range is not None:
        if len(c.sde_window_range) != 2:
            raise ValueError(f"sde_window_range must be [lo, hi), got {c.sde_window_range}.")
        check_range("sde_window_range[0]", c.sde_window_range[0], 0, STEP_LIMIT - 1)
        check_range("sde_window_range[1]", c.sde_window_range[1], c.sde_window_range[0] + 1, STEP_LIMIT,
                    fix="the window start is drawn from [lo, hi)")


def window_plan(c, num_steps: int, generator: torch.Generator | None, record_mean: bool) -> FlowPlan:
    """Flow-GRPO's plan for a config `c` with the window options of [`check_window`] and an ``sde``
    ([`SDEOptions`]): all steps SDE (training the first `timestep_fraction`), or a random window of SDE steps
    (Flow-GRPO-Fast); `record_mean` asks the rollout for the trained transitions' means (shared with `flow_dppo`)."""
    if c.sde_window_size == 0:
        sde_steps = list(range(num_steps))
        trained = sde_steps[: max(1, int(num_steps * c.timestep_fraction))]
    else:
        if c.sde_window_size > num_steps:
            raise ValueError(f"sde_window_size {c.sde_window_size} exceeds the {num_steps} sampling steps.")
        lo, hi = c.sde_window_range or [0, max(1, num_steps // 2)]
        hi = min(hi, num_steps - c.sde_window_size + 1)
        start = lo if hi <= lo else int(torch.randint(lo, hi, (1,), generator=generator))
        sde_steps = list(range(start, start + c.sde_window_size))
        trained = sde_steps
    return FlowPlan(num_steps=num_steps, sde_steps=sde_steps, train_units=[[s] for s in trained],
                    noise_level=c.sde.noise_level, sde_type=c.sde.sde_type, record_mean=record_mean)


class FlowGRPO:
    """Flow-GRPO: group-normalised advantages, clipped per-step likelihood ratio, optional KL to the reference."""

    Config = FlowGRPOConfig
    scoring = "trajectory"
    plan_family = "flow"  # the plan type `schedule` returns
    advantages = _options.advantages  # the shared advantage options

    def __init__(self, config: FlowGRPOConfig):
        self.config = config
        self.kl = KLWeight(config.kl)  # the KL weight, moving under a schedule
        # the KL term reads the transitions' means and the scale its convention divides by
        scale_field = {"transition": "std", "flow_grpo": "noise_scale"}[config.kl_convention]
        kl_reads = {"mean", scale_field} if self.kl.ever_positive else set()
        self.traits = AlgorithmTraits(reads=frozenset({"log_prob"} | kl_reads | config.ratio.reads),
                                      needs_reference=self.kl.ever_positive,
                                      group_local_advantages=config.advantage.group_local,
                                      drop_zero_advantage=config.drop_zero_advantage)

    def schedule(self, num_steps: int, generator: torch.Generator | None = None) -> FlowPlan:
        """All steps SDE (training the first `timestep_fraction`), or a random window of SDE steps."""
        return window_plan(self.config, num_steps, generator, record_mean=self.config.ratio.ratio_norm)

    def loss(self, new: Score, old_log_prob, advantages, ref: Score | None = None) -> LossOutput:
        """Clipped surrogate on one unit of steps, plus the KL term.

        Args:
            new ([`Score`]): ``log_prob`` `[n, k]`; with a KL term ``mean`` `[n, k, ...]` and ``std`` or
                ``noise_scale`` `[n, k, 1, ...]` (by `kl_convention`) from the policy; with `ratio_norm` ``mean``,
                ``old_mean``, ``std`` and ``noise_scale``.
            old_log_prob (`torch.FloatTensor` of shape `[n, k]`): log-probs recorded at sampling.
            advantages (`torch.FloatTensor` of shape `[n]`).
            ref ([`Score`], *optional*): the reference policy's ``mean`` for the KL term.
        """
        clip = self.config.clip
        log_ratio, dt = self.config.ratio.log_ratio(new, old_log_prob)  # [n, k], GRPO-Guard's |dt| [n, k] or None
        loss, metrics = clipped_surrogate(log_ratio, advantages, clip.clip_low, clip.high,
                                          weight=None if dt is None else 1 / dt)
        beta = self.kl()
        if beta > 0 and ref is not None:
            scale = new.std if self.config.kl_convention == "transition" else new.noise_scale
            kl = gaussian_mean_kl(new.mean, ref.mean, scale)
            loss = loss + beta * kl
            metrics.update(kl=kl.item(), kl_beta=float(beta))
        return LossOutput(loss=loss, metrics=metrics)


PLUGIN = FlowGRPO
