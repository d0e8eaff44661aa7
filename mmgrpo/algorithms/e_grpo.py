"""E-GRPO: one (merged, higher-entropy) SDE step per sample, branched from a deterministic anchor shared by its group.

Paper: https://arxiv.org/abs/2601.00423 (code: shengjun-zhang/VisualGRPO, ``grpo_merge``). Low-entropy consecutive
steps are merged into one SDE transition from ``sigma_i`` to ``sigma_{i+m}`` (fixed spans as in the authors' configs,
or the fewest steps whose transition entropy per element, ``0.5 * log(2 pi e std^2)``, reaches `entropy_threshold`);
every other step is deterministic (ODE). The samples of a group start from one initial noise and follow one ODE
anchor, computed once per group, up to their SDE step; member `m` of a group branches at ``sde_steps[m % K]``.
Advantages are normalised within the samples that share a prompt *and* an SDE step (the multi-step group-normalised
advantage): the rollout re-keys its group ids by branch.

Advantages as the authors' code: the unbiased std (PyTorch's ``std``) + 1e-8, clamped to ``[-5, 5]``. An optional KL
term (``kl_beta``; off by default) is the exact KL of the Gaussian transitions to the reference at each sample's own
SDE step, as `flow_grpo`'s ``kl_convention: transition``.

With ``ratio_norm: true`` (default off) each sample's SDE step takes GRPO-Guard's normalised ratio and ``1 / |dt|``
weight (https://arxiv.org/abs/2510.22319; see `flow_grpo` and [`~mmgrpo.losses.ratio_norm`]), ``|dt|`` the whole
(merged) step's ``sigma_i - sigma_{i+m}``: our combination, neither paper's.

Not implemented: the authors' multi-granularity rewards (ODE continuations with strides ``granular_list``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..losses import clipped_surrogate
from ..plans import FlowPlan
from ..types import AlgorithmTraits, LossOutput, Score
from ..validation import check_fields, check_range, embedded
from ._limits import SCALE_LIMIT, STEP_LIMIT
from . import _options
from ._options import (
    FASTVIDEO_ADVANTAGES, AdvantageOptions, ClipOptions, KLOptions, KLWeight, RatioOptions, SDEOptions,
)


@dataclass
class EGRPOConfig:
    """Options of [`EGRPO`]: its own and the shared clip, KL and advantage options (written flat, see
    ``mmgrpo show e_grpo``) with the authors' defaults.

    Args:
        sde_steps (`list[int]`): the branch steps (the authors' ``eta_step_list``); with `K` of them, each group splits
            into `K` sub-groups of ``group_size / K`` samples (make `train.group_size` a multiple of `K`, with at
            least 2 samples per sub-group).
        merge_steps (`list[int]`, *optional*): how many scheduler intervals each SDE step spans (the authors'
            ``eta_step_merge_list``, one per entry of `sde_steps`). Default: adaptive with `entropy_threshold`, or 1.
        entropy_threshold (`float`, *optional*): adaptive merging when `merge_steps` is not given: each SDE step
            spans the fewest intervals (at most `max_merge`) whose transition entropy per latent element reaches this
            value in nats. For reference, one step of 10 with shift 3 and eta 0.7 has about 1.1 nats at the start and
            0.1 near the end; merging two doubles the variance (+0.35 nats).
        max_merge (`int`): the longest adaptive merge.
        clip_low (`float`): the SDE step's ratio is clipped to ``[1 - clip_low,
            1 + clip_high]`` (1e-4, symmetric).
        adv_std (`str`), adv_eps (`float`): VisualGRPO's unbiased std (PyTorch's ``std``) + 1e-8; the std is the
            sub-group's (or the batch's with ``scale_rewards: batch``).
        adv_clip_max (`float`, *optional*): advantages are clamped to ``[-adv_clip_max, adv_clip_max]`` (5).
        kl_beta (`float`): weight of the exact transition KL to the reference at each sample's SDE step (0: off, no
            reference forward).
        ratio_norm (`bool`): GRPO-Guard's RatioNorm and ``1 / |dt|`` step weight on each sample's SDE step (off).
    """

    sde_steps: list[int] = field(default_factory=lambda: [1])
    merge_steps: list[int] | None = None
    entropy_threshold: float | None = None
    max_merge: int = 4
    clip: ClipOptions = embedded(ClipOptions, clip_low=1e-4)
    advantage: AdvantageOptions = embedded(AdvantageOptions, **FASTVIDEO_ADVANTAGES)
    kl: KLOptions = embedded(KLOptions, kl_beta=0.0)
    sde: SDEOptions = embedded(SDEOptions, noise_level=0.7)
    ratio: RatioOptions = embedded(RatioOptions)

    def __post_init__(self):
        check_fields(self)
        self.ratio.check_sde(self.sde)
        if self.entropy_threshold is not None:
            check_range("entropy_threshold", self.entropy_threshold, 0, SCALE_LIMIT, low_open=True)
        for key, steps in (("sde_steps", self.sde_steps), ("merge_steps", self.merge_steps or [])):
            for i, step in enumerate(steps):
                check_range(f"{key}[{i}]", step, 0 if key == "sde_steps" else 1, STEP_LIMIT,
                            fix="a denoising-step index or count")
        check_range("max_merge", self.max_merge, 1, STEP_LIMIT, fix="a count of denoising steps")
        if not self.sde_steps or len(set(self.sde_steps)) != len(self.sde_steps):
            raise ValueError(f"sde_steps must be distinct step indices >= 0, got {self.sde_steps}.")
        if self.merge_steps is not None:
            if len(self.merge_steps) != len(self.sde_steps):
                raise ValueError(
                    f"merge_steps {self.merge_steps} must give one span >= 1 per SDE step {self.sde_steps}."
                )
            if self.entropy_threshold is not None:
                raise ValueError("Give either merge_steps (fixed spans) or entropy_threshold (adaptive), not both.")


class EGRPO:
    """E-GRPO: branches from a shared anchor at (merged) SDE steps; advantages per (prompt, SDE step)."""

    Config = EGRPOConfig
    scoring = "trajectory"
    plan_family = "flow"  # the plan type `schedule` returns
    advantages = _options.advantages  # per (prompt, SDE step): the rollout's branch group ids

    def __init__(self, config: EGRPOConfig):
        self.config = config
        self.kl = KLWeight(config.kl)  # the KL weight, moving under a schedule
        reads = {"log_prob", "mask"} | self.kl.transition_reads | config.ratio.reads  # mask: each sample's step
        self.traits = AlgorithmTraits(reads=frozenset(reads),
                                      needs_reference=self.kl.ever_positive,
                                      group_local_advantages=config.advantage.group_local)

    def schedule(self, num_steps: int, generator: torch.Generator | None = None) -> FlowPlan:
        """A branching plan: ODE anchor per group, one SDE step per sample, all SDE steps trained as one unit (each
        sample's entry is its own step; the policy's ``mask`` says which)."""
        c = self.config
        spans = c.merge_steps or [1] * len(c.sde_steps)
        too_late = [(s, m) for s, m in zip(c.sde_steps, spans) if s + m > num_steps]
        if too_late:
            raise ValueError(
                f"algorithm.sde_steps / merge_steps {too_late} end past the {num_steps} sampling steps: use steps "
                f"with step + span <= pipeline.num_steps."
            )
        return FlowPlan(
            num_steps=num_steps,
            sde_steps=list(c.sde_steps),
            train_units=[list(c.sde_steps)],
            noise_level=c.sde.noise_level,
            sde_type=c.sde.sde_type,
            merge=dict(zip(c.sde_steps, c.merge_steps)) if c.merge_steps else {},
            merge_entropy=c.entropy_threshold,
            max_merge=c.max_merge,
            branch=True,
            seed=int(torch.randint(0, 2**62, (1,), generator=generator)),
            record_mean=c.ratio.ratio_norm,
        )

    def loss(self, new: Score, old_log_prob, advantages, ref: Score | None = None) -> LossOutput:
        """Clipped surrogate on each sample's SDE step, plus the KL term.

        Args:
            new ([`Score`]): ``log_prob`` `[n, K]` and ``mask`` `[n, K]` (true at each sample's own SDE step); with a
                KL term ``mean`` `[n, K, ...]` and ``std`` `[n, K, 1, ...]`; with `ratio_norm` ``mean``, ``old_mean``,
                ``std`` and ``noise_scale``.
            old_log_prob (`torch.FloatTensor` of shape `[n, K]`): log-probs recorded at sampling.
            advantages (`torch.FloatTensor` of shape `[n]`).
            ref ([`Score`], *optional*): the reference policy's ``mean`` for the KL term.
        """
        clip = self.config.clip
        log_ratio, dt = self.config.ratio.log_ratio(new, old_log_prob)  # [n, K], GRPO-Guard's |dt| [n, K] or None
        loss, metrics = clipped_surrogate(log_ratio, advantages, clip.clip_low, clip.high, new.mask,
                                          weight=None if dt is None else 1 / dt)
        loss = self.kl.add_transition_kl(loss, metrics, new, ref)
        return LossOutput(loss=loss, metrics=metrics)

PLUGIN = EGRPO
