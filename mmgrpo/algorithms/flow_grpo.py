"""Flow-GRPO: clipped per-step policy gradient through the SDE steps of a flow-matching sampler.

Paper: https://arxiv.org/abs/2505.05470 (Flow-GRPO-Fast: SDE on a window of steps, ODE elsewhere).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from ..advantages import StdEstimator, group_normalize
from ..types import AlgorithmTraits, LossOutput, Score
from ..plans import FlowPlan
from ._limits import ADV_CLIP_LIMIT, CLIP_LIMIT, KL_BETA_LIMIT, NOISE_LEVEL_RANGE, STEP_LIMIT
from ..validation import check_fields, check_range


@dataclass
class FlowGRPOConfig:
    """Options of [`FlowGRPO`].

    Args:
        clip_low (`float`): PPO clip of the per-step ratio, clipped to ``[1 - clip_low, 1 + clip_high]`` (Flow-GRPO:
            1e-4; 1e-5 for Fast / CPS).
        clip_high (`float`, *optional*): unset: `clip_low` (a symmetric clip, Flow-GRPO's).
        adv_clip_max (`float`): advantages are clamped to ``[-adv_clip_max, adv_clip_max]``.
        kl_beta (`float`): weight of the KL to the reference policy (0 disables the reference forward).
        kl_convention (`str`): what `kl_beta` multiplies, per element of a transition's mean, averaged:

            - ``"transition"``: the exact KL of the two Gaussian transitions,
              ``(mu - mu_ref)^2 / (2 sigma_t^2 |dt|)`` (``std = sigma_t sqrt(|dt|)``);
            - ``"flow_grpo"``: Flow-GRPO's published code, ``(mu - mu_ref)^2 / (2 sigma_t^2)``, which is
              ``"transition"`` times ``|dt|``: at 10 steps about 10x weaker for one beta. The authors' betas
              (0.04 GenEval / OCR, 0.01 PickScore, 0.004 Wan) mean what they mean there only with this convention.
              For CPS both divide by the transition std (the two conventions agree).
        noise_level (`float`): SDE noise scale eta (0.7 for SDE, 0.8 for CPS in the authors' configs).
        sde_type (`str`): ``"sde"`` or ``"cps"``.
        sde_window_size (`int`): Flow-GRPO-Fast: number of consecutive SDE steps (0: every step is SDE).
        sde_window_range (`list[int]`, *optional*): ``[lo, hi)`` range of the window start (default: the first
            half of the steps).
        timestep_fraction (`float`): without a window, the first ``int(num_steps * fraction)`` steps are trained.
        global_std (`bool`): normalise by the batch standard deviation instead of the group's.
        adv_std (`str`): the std estimator of the advantages, ``"population"`` (n, Flow-GRPO's) or ``"unbiased"``.
    """

    clip_low: float = 1e-4
    clip_high: float | None = None
    adv_clip_max: float = 5.0
    kl_beta: float = 0.0
    kl_convention: Literal["transition", "flow_grpo"] = "transition"
    noise_level: float = 0.7
    sde_type: Literal["sde", "cps"] = "sde"
    sde_window_size: int = 0
    sde_window_range: list[int] | None = None
    timestep_fraction: float = 1.0
    global_std: bool = False
    adv_std: StdEstimator = "population"

    def __post_init__(self):
        check_fields(self)
        check_range("adv_clip_max", self.adv_clip_max, 0, ADV_CLIP_LIMIT, low_open=True)
        check_range("kl_beta", self.kl_beta, 0, KL_BETA_LIMIT, fix="0 turns the KL term off")
        check_range("noise_level", self.noise_level, *NOISE_LEVEL_RANGE, fix="0.7 is usual")
        check_range("sde_window_size", self.sde_window_size, high=STEP_LIMIT, fix="0: every step is an SDE step")
        for key, clip in (("clip_low", self.clip_low), ("clip_high", self.clip_high)):
            if clip is not None:
                check_range(key, clip, high=CLIP_LIMIT, fix="the ratio is clipped to [1 - clip_low, 1 + clip_high]")
        if self.sde_window_range is not None and len(self.sde_window_range) == 2:
            check_range("sde_window_range[0]", self.sde_window_range[0], 0, STEP_LIMIT - 1)
            check_range("sde_window_range[1]", self.sde_window_range[1], self.sde_window_range[0] + 1, STEP_LIMIT,
                        fix="the window start is drawn from [lo, hi)")
        if self.clip_low <= 0 or (self.clip_high is not None and self.clip_high <= 0):
            raise ValueError(f"clip_low and clip_high must be > 0, got {self.clip_low} and {self.clip_high}.")
        if self.noise_level <= 0:
            raise ValueError(f"noise_level must be > 0 for a stochastic policy, got {self.noise_level}.")
        if self.sde_window_size < 0:
            raise ValueError(f"sde_window_size must be >= 0, got {self.sde_window_size}.")
        if not 0 < self.timestep_fraction <= 1:
            raise ValueError(f"timestep_fraction must be in (0, 1], got {self.timestep_fraction}.")
        if self.sde_window_range is not None and len(self.sde_window_range) != 2:
            raise ValueError(f"sde_window_range must be [lo, hi), got {self.sde_window_range}.")


class FlowGRPO:
    """Flow-GRPO: group-normalised advantages, clipped per-step likelihood ratio, optional KL to the reference."""

    Config = FlowGRPOConfig
    scoring = "trajectory"
    plan_family = "flow"  # the plan type `schedule` returns

    def __init__(self, config: FlowGRPOConfig):
        self.config = config
        # the KL term reads the transitions' means and the scale its convention divides by
        scale_field = {"transition": "std", "flow_grpo": "noise_scale"}[config.kl_convention]
        kl_reads = {"mean", scale_field} if config.kl_beta > 0 else set()
        self.traits = AlgorithmTraits(reads=frozenset({"log_prob"} | kl_reads), needs_reference=config.kl_beta > 0,
                                      group_local_advantages=not config.global_std)

    def schedule(self, num_steps: int, generator: torch.Generator | None = None) -> FlowPlan:
        """All steps SDE (training the first `timestep_fraction`), or a random window of SDE steps."""
        c = self.config
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
        return FlowPlan(
            num_steps=num_steps,
            sde_steps=sde_steps,
            train_units=[[s] for s in trained],
            noise_level=c.noise_level,
            sde_type=c.sde_type,
        )

    def advantages(self, scores: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
        return group_normalize(scores, group_ids, global_std=self.config.global_std, clip=self.config.adv_clip_max,
                               std=self.config.adv_std)

    def loss(self, new: Score, old_log_prob, advantages, ref: Score | None = None) -> LossOutput:
        """Clipped surrogate on one unit of steps.

        Args:
            new ([`Score`]): ``log_prob`` `[n, k]`; with a KL term ``mean`` `[n, k, ...]` and ``std`` or
                ``noise_scale`` `[n, k, 1, ...]` (by `kl_convention`) from the policy.
            old_log_prob (`torch.FloatTensor` of shape `[n, k]`): log-probs recorded at sampling.
            advantages (`torch.FloatTensor` of shape `[n]`).
            ref ([`Score`], *optional*): the reference policy's ``mean`` for the KL term.
        """
        low = self.config.clip_low
        high = low if self.config.clip_high is None else self.config.clip_high
        adv = advantages[:, None]  # [n, 1]
        log_ratio = new.log_prob - old_log_prob  # [n, k]
        ratio = torch.exp(log_ratio)
        unclipped = -adv * ratio
        clipped = -adv * torch.clamp(ratio, 1 - low, 1 + high)
        policy_loss = torch.maximum(unclipped, clipped).mean()
        loss = policy_loss
        metrics = {
            "policy_loss": policy_loss.item(),
            "ratio_mean": ratio.mean().item(),
            "clip_frac": torch.where(ratio < 1, 1 - ratio > low, ratio - 1 > high).float().mean().item(),
            "approx_kl": 0.5 * (log_ratio.detach() ** 2).mean().item(),
        }
        if self.traits.needs_reference and ref is not None:
            scale = new.std if self.config.kl_convention == "transition" else new.noise_scale
            kl = gaussian_mean_kl(new.mean, ref.mean, scale)
            loss = loss + self.config.kl_beta * kl
            metrics["kl"] = kl.item()
        return LossOutput(loss=loss, metrics=metrics)


def gaussian_mean_kl(mean: torch.Tensor, ref_mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """``(mean - ref_mean)^2 / (2 std^2)`` averaged over elements: the KL between two Gaussians of std `std` when
    `std` is the transition's (``kl_convention="transition"``), Flow-GRPO's term when it is ``sigma_t``. Entries
    with std 0 (deterministic transitions, placeholders) contribute nothing.
    """
    safe = torch.where(std > 0, std, torch.ones_like(std))
    kl = (mean - ref_mean.detach()) ** 2 / (2 * safe**2)
    return torch.where(std > 0, kl, torch.zeros_like(kl)).mean()


PLUGIN = FlowGRPO
