"""The options every algorithm shares, one record each, checked once: the advantage estimator ([`AdvantageOptions`]),
the ratio clip ([`ClipOptions`]), the KL weight with its schedule ([`KLOptions`], held at run time as a
[`KLWeight`], the algorithm's declared ``kl`` member), the SDE steps of the flow algorithms ([`SDEOptions`]) and the
per-step ratio of the flow algorithms that replay SDE transitions ([`RatioOptions`]: GRPO-Guard's RatioNorm) and the
correction of rollouts whose engine's log-probs differ from the trainer's ([`RolloutCorrectionOptions`]).

An algorithm's ``Config`` embeds them with [`~mmgrpo.validation.embedded`], giving its own (its authors') defaults::

    advantage: AdvantageOptions = embedded(AdvantageOptions, adv_std="population", adv_clip_max=5.0)

A config file writes their keys flat under ``algorithm:`` (``scale_rewards: batch``, ``kl_beta: 0.04``, as TRL's
names); a key it leaves out keeps the algorithm's default. ``mmgrpo show NAME`` lists them with the algorithm's
defaults. Not a plugin: the name starts with an underscore.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

from ..advantages import StdEstimator, group_normalize, tempsamp_soft
from ..losses import gaussian_mean_kl, ratio_norm
from ..types import Score
from ..validation import ConfigError, check_fields, check_range
from ._limits import (
    ADV_CLIP_LIMIT, ADV_EPS_LIMIT, CLIP_LIMIT, KL_BETA_LIMIT, NOISE_LEVEL_RANGE, SCALE_LIMIT, UPDATES_LIMIT,
)

# the advantages of GCPO's (Chunk-GRPO) and VisualGRPO's (E-GRPO) code, both built on DanceGRPO's fastvideo: the group's
# std as PyTorch computes it (unbiased) + 1e-8, clamped to [-5, 5] in the loss
FASTVIDEO_ADVANTAGES = {"scale_rewards": "group", "adv_std": "unbiased", "adv_eps": 1e-8, "adv_clip_max": 5.0}
RewardScaling = Literal["group", "batch", "none"]
AdvantageTransform = Literal["none", "tempsamp_soft"]
KLSchedule = Literal["constant", "linear", "cosine"]
RolloutCorrection = Literal["recompute", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask",
                            "token_reject", "sequence_reject", "geometric_reject"]


@dataclass
class AdvantageOptions:
    """How rewards become advantages: ``A = (r - mean_group(r)) / (std + adv_eps)``, clamped to ``[-adv_clip_max,
    adv_clip_max]``; see [`~mmgrpo.advantages.group_normalize`]. A sample whose reward is not finite is left out of the
    statistics and gets 0; a group whose rewards are all equal gets exactly 0.

    Args:
        scale_rewards (`str`): the std divided by (TRL's names): ``"group"``, the group's; ``"batch"``, the whole
            batch's (the mean stays the group's; Flow-GRPO's and DGPO's ``global_std: true``); ``"none"``, no
            division (mean-centring only: Dr. GRPO, d1, CJ-GRPO's code, GDPO).
        adv_std (`str`): the std's estimator: ``"unbiased"`` (n - 1; PyTorch's ``std``: TRL, GCPO, VisualGRPO) or
            ``"population"`` (n; NumPy's ``std``: Flow-GRPO, DGPO). At n = 2 the unbiased std is sqrt(2) times the
            population one.
        adv_eps (`float`): added to the std (TRL, Flow-GRPO, DGPO: 1e-4; GCPO, VisualGRPO: 1e-8).
        adv_clip_max (`float`, *optional*): clamp the advantages to ``[-adv_clip_max, adv_clip_max]`` (the flow
            papers' 5); unset: no clamp.
        advantage_transform (`str`): ``"none"``, or ``"tempsamp_soft"``: TempSamp-R1's asymmetric soft transform of
            each reward before the group statistics, ``tau + a_high * log(r - tau + 1)`` for ``r >= tau`` (rewards
            above the threshold nearly flattened) and ``tau - (exp(a_low * (tau - r)) - 1) / (exp(a_low) - 1)`` below
            it (a growing penalty the further below), with ``tau`` = `soft_threshold`.
        soft_threshold (`float`): ``tau`` of the soft transform (TempSamp-R1: 0.8 on a temporal IoU).
        soft_alpha_high (`float`): ``a_high``, the slope of the log above ``tau`` (0.01).
        soft_alpha_low (`float`): ``a_low`` (> 0), the curvature of the exponential below ``tau`` (1.0).
    """

    scale_rewards: RewardScaling = "group"
    adv_std: StdEstimator = "unbiased"
    adv_eps: float = 1e-4
    adv_clip_max: float | None = None
    advantage_transform: AdvantageTransform = "none"
    soft_threshold: float = 0.8
    soft_alpha_high: float = 0.01
    soft_alpha_low: float = 1.0

    def __post_init__(self):
        check_fields(self)
        check_range("adv_eps", self.adv_eps, 0, ADV_EPS_LIMIT, low_open=True, fix="1e-4 is usual")
        if self.adv_clip_max is not None:
            check_range("adv_clip_max", self.adv_clip_max, 0, ADV_CLIP_LIMIT, low_open=True,
                        fix="5 is usual; leave it unset for no clamp")
        check_range("soft_threshold", self.soft_threshold, -SCALE_LIMIT, SCALE_LIMIT, fix="a reward level, e.g. 0.8")
        check_range("soft_alpha_high", self.soft_alpha_high, 0, SCALE_LIMIT,
                    fix="0 makes every reward above soft_threshold equal")
        check_range("soft_alpha_low", self.soft_alpha_low, 0, SCALE_LIMIT, low_open=True, fix="TempSamp-R1 uses 1")

    @property
    def group_local(self) -> bool:
        """Whether a sample's advantage reads its own group only (not under ``scale_rewards: batch``)."""
        return self.scale_rewards != "batch"

    def compute(self, scores: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
        """The advantages `[N]` of `scores` `[N]` (gathered from every process; NaN: not applicable) in groups
        `group_ids` `[N]`: the soft transform when asked, then the group statistics and the clamp."""
        if self.advantage_transform == "tempsamp_soft":
            scores = tempsamp_soft(scores, self.soft_threshold, self.soft_alpha_high, self.soft_alpha_low)  # [N]
        return group_normalize(scores, group_ids, scale=self.scale_rewards, eps=self.adv_eps, clip=self.adv_clip_max,
                               std=self.adv_std)


@dataclass
class ClipOptions:
    """The clip of an importance ratio ``r`` to ``[1 - clip_low, 1 + clip_high]`` (PPO's; TRL's ``epsilon`` /
    ``epsilon_high``).

    Args:
        clip_low (`float`): the lower clip, ``1 - clip_low``, in (0, 1).
        clip_high (`float`, *optional*): the upper clip, ``1 + clip_high``; unset: `clip_low` (a symmetric clip, as
            TRL's ``epsilon_high`` unset). An algorithm whose authors clip asymmetrically sets it (DAPO's 0.28).
    """

    clip_low: float = 0.2
    clip_high: float | None = None

    def __post_init__(self):
        check_fields(self)
        check_range("clip_low", self.clip_low, 0, 1, low_open=True, high_open=True,
                    fix="the ratio is clipped at 1 - clip_low")
        if self.clip_high is not None:
            check_range("clip_high", self.clip_high, 0, CLIP_LIMIT, low_open=True,
                        fix="the ratio is clipped at 1 + clip_high; leave it unset for a symmetric clip")

    @property
    def high(self) -> float:
        """The upper clip in use: `clip_high`, or `clip_low` when unset."""
        return self.clip_low if self.clip_high is None else self.clip_high


@dataclass
class SDEOptions:
    """The SDE steps of a flow-matching rollout (Flow-GRPO's sampler, `mmgrpo/samplers/flow_sde.py`).

    Args:
        noise_level (`float`): the SDE's noise scale eta (Flow-GRPO's configs: 0.7 for SDE, 0.8 for CPS; DanceGRPO's:
            0.3).
        sde_type (`str`): ``"sde"`` (Flow-GRPO's step), ``"cps"`` (coefficient-preserving sampling) or ``"dance"``
            (DanceGRPO's step: ``mu = x + dsigma v - eta^2 s_hat dsigma / 2``, std ``eta sqrt(|dsigma|)``; see
            [`~mmgrpo.samplers.flow_sde.dance_step_mean`]). MixGRPO's ``--flow_grpo_sampling`` is ``"sde"``, its
            default (the flag off) ``"dance"``.
    """

    noise_level: float = 0.7
    sde_type: Literal["sde", "cps", "dance"] = "sde"

    def __post_init__(self):
        check_fields(self)
        check_range("noise_level", self.noise_level, *NOISE_LEVEL_RANGE, fix="0.7 is usual")


@dataclass
class RatioOptions:
    """The per-step importance ratio of a flow algorithm that replays SDE transitions (`flow_grpo`, `e_grpo`,
    `chunk_grpo`).

    Args:
        ratio_norm (`bool`): GRPO-Guard (https://arxiv.org/abs/2510.22319; code: the GRPO-Guard scripts of
            yifan123/flow_grpo, verl-omni's ``grpo_guard`` loss). Off: ``r = exp(log pi_theta - log pi_old)``. On:
            RatioNorm, ``r = exp(s (log pi_theta - log pi_old) + mean(|mu_theta - mu_old|^2) / (2 s))`` with ``s =
            sigma_t sqrt(|dt|)`` the transition std, which removes the per-step negative mean of the log-ratio (so
            the clip binds on both sides) and its dependence on the noise level; and the gradient reweight, each
            step's clipped objective divided by its ``|dt|``. The rollout then records the mean ``mu_old`` of every
            trained transition (plan feature ``"old_mean"``; memory: one latent per trained step and sample). Needs
            ``sde_type: sde`` (the Gaussian log-density the identity is about).
    """

    ratio_norm: bool = False

    def __post_init__(self):
        check_fields(self)

    @property
    def reads(self) -> frozenset[str]:
        """The [`~mmgrpo.types.Score`] fields the ratio reads besides ``log_prob``."""
        return frozenset({"mean", "old_mean", "std", "noise_scale"}) if self.ratio_norm else frozenset()

    def check_sde(self, sde: "SDEOptions") -> None:
        """Refuses RatioNorm on an SDE whose log-probability is not the Gaussian density (CPS's surrogate...)."""
        if self.ratio_norm and sde.sde_type != "sde":
            raise ConfigError(f"ratio_norm (GRPO-Guard) normalises the Gaussian log-density of Flow-GRPO's SDE step; "
                              f"sde_type {sde.sde_type!r} scores another quantity: use sde_type: sde, or ratio_norm: "
                              f"false.")

    def log_ratio(self, new: Score, old_log_prob: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The per-step log-ratio `[n, k]` of `new` to the sampling policy and, with `ratio_norm`, the step lengths
        ``|dt|`` `[n, k]` (GRPO-Guard divides each step's objective by its ``|dt|``; `None` without)."""
        log_ratio = new.log_prob - old_log_prob  # [n, k]
        if not self.ratio_norm:
            return log_ratio, None
        return ratio_norm(log_ratio, new.mean, new.old_mean, new.std, new.noise_scale)


@dataclass
class KLOptions:
    """The weight of an algorithm's KL term and its schedule over the optimizer updates.

    Args:
        kl_beta (`float`): the weight of the KL term (at the first update under a schedule); 0 turns it off (and the
            reference's forward pass, where only the KL reads the reference).
        kl_schedule (`str`): how the weight moves over the optimizer updates taken (OThink-MR1's dynamic KL, GRPO-D:
            low early to explore, higher later to hold the policy near the reference). ``"constant"``: always
            `kl_beta`. ``"linear"`` / ``"cosine"``: from `kl_beta` at the first update to `kl_beta_end` after
            `kl_warmup_steps` updates, then constant: with ``p = min(1, u / kl_warmup_steps)`` after `u` updates, the
            weight is ``kl_beta + (kl_beta_end - kl_beta) * w(p)``, ``w(p) = p`` or ``(1 - cos(pi p)) / 2``. The update
            count is checkpointed (a resumed run continues the schedule).
        kl_beta_end (`float`, *optional*): the KL weight a ``"linear"`` / ``"cosine"`` schedule reaches (required by
            them, refused under ``"constant"``).
        kl_warmup_steps (`int`): the optimizer updates over which the schedule moves (one trainer step takes
            ``inner_epochs * updates_per_step`` of them); 0 under ``"constant"``.
    """

    kl_beta: float = 0.0
    kl_schedule: KLSchedule = "constant"
    kl_beta_end: float | None = None
    kl_warmup_steps: int = 0

    def __post_init__(self):
        check_fields(self)
        check_range("kl_beta", self.kl_beta, 0, KL_BETA_LIMIT, fix="0 turns the KL term off")
        if self.kl_schedule == "constant":
            if self.kl_beta_end is not None or self.kl_warmup_steps != 0:
                raise ConfigError(
                    f"kl_beta_end={self.kl_beta_end!r} / kl_warmup_steps={self.kl_warmup_steps!r} apply only to a KL "
                    f"schedule: set kl_schedule to 'linear' or 'cosine', or leave them out (kl_beta stays constant)."
                )
            return
        if self.kl_beta_end is None:
            raise ConfigError(f"kl_schedule={self.kl_schedule!r} needs kl_beta_end, the KL weight it reaches after "
                              f"kl_warmup_steps optimizer updates (kl_beta is the weight at the start).")
        check_range("kl_beta_end", self.kl_beta_end, 0, KL_BETA_LIMIT, fix="the KL weight reached at the end of the "
                    "schedule")
        check_range("kl_warmup_steps", self.kl_warmup_steps, 1, UPDATES_LIMIT,
                    fix="the number of optimizer updates over which the KL weight moves from kl_beta to kl_beta_end")


@dataclass
class RolloutCorrectionOptions:
    """What a token algorithm does when the engine that sampled a rollout reports log-probs ``pi_rollout`` that differ
    from the trainer's forward of the same weights (another kernel, another dtype; ``Rollout.engine_log_probs``). The
    trainer first recomputes the old log-probs ``pi_old`` with its own forward, before any update of the step, and
    uses them as the ratio's old policy; the mismatch is logged every step (``rollout_corr/*``, see
    [`mmgrpo.rollout_correction`]). A rollout of the trainer's own forward (the local engine) needs none of this.

    Args:
        rollout_correction (`str`): with ``rho = pi_old / pi_rollout`` per token, or per sequence
            ``exp(sum_t log rho_t)`` over its completion tokens (TRL's ``vllm_importance_sampling_mode`` values, which
            do what TRL's do, the per-token policy loss multiplied by the weight, the KL term not):

            - ``"recompute"``: the recomputed old log-probs alone, no weight.
            - ``"token_truncate"`` / ``"sequence_truncate"``: weight ``clamp(rho, rollout_is_clip_min,
              rollout_is_clip_max)`` (truncated importance sampling, TIS).
            - ``"token_mask"`` / ``"sequence_mask"``: weight ``rho`` inside ``[rollout_is_clip_min,
              rollout_is_clip_max]``, 0 outside (masked importance sampling, MIS; a zero-weight token still counts in
              the loss's normaliser, as in TRL).
            - ``"token_reject"`` / ``"sequence_reject"`` / ``"geometric_reject"``: verl's rejection sampling
              (``rollout_rs: token | sequence | geometric``, no weight): tokens, or whole sequences by the product or
              the geometric mean ``exp(mean_t log rho_t)`` of their ratios, outside ``[rollout_rs_threshold_lower,
              rollout_rs_threshold]`` leave the trained tokens (``Rollout.mask``): they count in no normaliser.
        rollout_is_clip_max (`float`, *optional*): TRL's ``vllm_importance_sampling_clip_max`` (3.0); unset: no upper
            bound.
        rollout_is_clip_min (`float`, *optional*): TRL's ``vllm_importance_sampling_clip_min``; unset: no lower bound.
        rollout_rs_threshold (`float`): verl's ``rollout_rs_threshold``, the upper ratio bound of the reject modes
            (> 1; verl's geometric examples use 1.0002 - 1.001).
        rollout_rs_threshold_lower (`float`, *optional*): verl's ``rollout_rs_threshold_lower``; unset: ``1 /
            rollout_rs_threshold``, as verl.
    """

    rollout_correction: RolloutCorrection = "recompute"
    rollout_is_clip_max: float | None = 3.0
    rollout_is_clip_min: float | None = None
    rollout_rs_threshold: float = 2.0
    rollout_rs_threshold_lower: float | None = None

    def __post_init__(self):
        check_fields(self)
        if self.rollout_is_clip_max is not None:
            check_range("rollout_is_clip_max", self.rollout_is_clip_max, 0, SCALE_LIMIT, low_open=True,
                        fix="TRL's default is 3.0; leave it unset for no upper bound")
        if self.rollout_is_clip_min is not None:
            check_range("rollout_is_clip_min", self.rollout_is_clip_min, 0, self.rollout_is_clip_max or SCALE_LIMIT,
                        high_open=True, fix="a lower ratio bound below rollout_is_clip_max; leave it unset for none")
        check_range("rollout_rs_threshold", self.rollout_rs_threshold, 1, SCALE_LIMIT, low_open=True,
                    fix="an upper ratio bound above 1 (verl: 2.0 per sequence, 1.0002 - 1.001 geometric)")
        if self.rollout_rs_threshold_lower is not None:
            check_range("rollout_rs_threshold_lower", self.rollout_rs_threshold_lower, 0, 1, low_open=True,
                        high_open=True, fix="a lower ratio bound below 1; leave it unset for 1 / rollout_rs_threshold")

    @property
    def reject_bounds(self) -> tuple[float, float]:
        """The ratio bounds ``(lower, upper)`` of the reject modes."""
        lower = self.rollout_rs_threshold_lower
        return (1.0 / self.rollout_rs_threshold if lower is None else lower), self.rollout_rs_threshold


def advantages(self, scores: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """The protocol's ``advantages`` of an algorithm whose Config embeds an [`AdvantageOptions`] as ``advantage``:
    ``self.config.advantage.compute(scores, group_ids)`` (scores and group ids `[N]` gathered from every process ->
    `[N]`). Each algorithm takes it into its class by name (``advantages = _options.advantages``)."""
    return self.config.advantage.compute(scores, group_ids)


def kl_weight(options: KLOptions, updates: int) -> float:
    """The KL weight after `updates` optimizer updates under `options` (see [`KLOptions`]; OThink-MR1's GRPO-D: a low
    weight early lets the policy explore, a higher one later holds it near the reference; the schedule is ours,
    written out there). From update ``kl_warmup_steps`` on, the weight stays ``kl_beta_end``."""
    if options.kl_schedule == "constant":
        return options.kl_beta
    progress = min(1.0, updates / options.kl_warmup_steps)
    shape = progress if options.kl_schedule == "linear" else (1 - math.cos(math.pi * progress)) / 2
    return options.kl_beta + (options.kl_beta_end - options.kl_beta) * shape


@dataclass
class KLWeight:
    """An algorithm's KL weight: its [`KLOptions`] and the number of optimizer updates taken, its whole state. Every
    algorithm holds one as its ``kl`` member (see [`~mmgrpo.protocols.Algorithm`]): the trainer calls [`step`] after
    every optimizer update it takes (a skipped update does not count, as for the learning-rate schedule) and
    checkpoints [`state_dict`], so a resumed run continues a schedule exactly; the loss reads the weight by calling
    it, or adds the flow algorithms' KL terms with it ([`add_transition_kl`], [`add_velocity_kl`]).
    """

    options: KLOptions
    updates: int = 0

    @property
    def dynamic(self) -> bool:
        """Whether the weight moves (a schedule other than ``"constant"``)."""
        return self.options.kl_schedule != "constant"

    @property
    def ever_positive(self) -> bool:
        """Whether the weight is ever above 0 (the KL term, and what it reads, are then needed)."""
        return self.options.kl_beta > 0 or (self.dynamic and self.options.kl_beta_end > 0)

    @property
    def transition_reads(self) -> frozenset[str]:
        """The [`~mmgrpo.types.Score`] fields [`add_transition_kl`] reads: ``mean`` and ``std`` when the weight is ever
        above 0, none otherwise."""
        return frozenset({"mean", "std"}) if self.ever_positive else frozenset()

    def __call__(self) -> float:
        return kl_weight(self.options, self.updates)

    def add_transition_kl(self, loss: torch.Tensor, metrics: dict, new: Score, ref: Score | None) -> torch.Tensor:
        """`loss` plus the current weight times the exact KL of the Gaussian SDE transitions to the reference,
        [`~mmgrpo.losses.gaussian_mean_kl`] of `new`'s ``mean`` `[n, k, ...]` and ``std`` `[n, k, 1, ...]` and `ref`'s
        ``mean``, over `new`'s ``mask`` (`flow_grpo`'s ``kl_convention: transition``), recorded in `metrics` as ``kl``
        and ``kl_beta``; `loss` itself while the weight is 0 or without a reference."""
        beta = self()
        if beta <= 0 or ref is None:
            return loss
        kl = gaussian_mean_kl(new.mean, ref.mean, new.std, new.mask)
        metrics.update(kl=kl.item(), kl_beta=float(beta))
        return loss + beta * kl

    def add_velocity_kl(self, loss: torch.Tensor, metrics: dict, new: Score, ref: Score | None) -> torch.Tensor:
        """`loss` plus the current weight times the velocity-space KL to the reference of the likelihood algorithms,
        ``mean ||v - v_ref||^2`` (`new`'s and `ref`'s ``velocity`` `[n, k, ...]`, averaged per point, then over the
        points), recorded in `metrics` as ``kl`` and ``kl_beta``; `loss` itself while the weight is 0."""
        beta = self()
        if beta <= 0:
            return loss
        dims = tuple(range(2, new.velocity.dim()))
        kl = ((new.velocity - ref.velocity.detach()) ** 2).mean(dim=dims)  # [n, k]
        metrics.update(kl=kl.mean().item(), kl_beta=float(beta))
        return loss + beta * kl.mean()

    def step(self) -> None:
        """One optimizer update taken."""
        self.updates += 1

    def state_dict(self) -> dict:
        return {"kl_updates": self.updates}

    def load_state_dict(self, state: dict) -> None:
        self.updates = int(state["kl_updates"])
