"""Dr. GRPO: GRPO without the std scaling of advantages and without per-response length normalisation.

Paper: "Understanding R1-Zero-Like Training: A Critical Perspective", https://arxiv.org/abs/2503.20783. Advantages
are ``r - mean_group(r)``; the loss of a minibatch is ``sum_{i,t} max(-A_i r_it, -A_i clip(r_it)) / (n * T)`` with
`T` the fixed maximum completion length (the policy's ``num_steps``), as TRL's ``loss_type="dr_grpo"``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..advantages import group_normalize
from ..losses import clipped_objective
from ..types import AlgorithmTraits, LossOutput, Score
from ..plans import TokenPlan
from ._token import (
    SHARED_DOCS, AdvantageTransform, KLSchedule, KLWeight, attach_kl_members, check_shared, shaped_scores,
    TOKEN_READS, add_kl, aggregate, check_options, ratio_metrics, token_mask, token_plan,
)
from ..validation import check_fields


@dataclass
class DrGRPOConfig:
    """Options of [`DrGRPO`].

    Args:
        clip_low (`float`), clip_high (`float`): the token ratio is clipped to ``[1 - clip_low, 1 + clip_high]``.
        kl_beta (`float`): weight of the k3 KL to the reference (the paper uses none: 0).
    """

    clip_low: float = 0.2
    clip_high: float = 0.2
    kl_beta: float = 0.0
    kl_schedule: KLSchedule = "constant"
    kl_beta_end: float | None = None
    kl_warmup_steps: int = 0
    advantage_transform: AdvantageTransform = "none"
    soft_threshold: float = 0.8
    soft_alpha_high: float = 0.01
    soft_alpha_low: float = 1.0
    ground_truth_member: bool = False

    def __post_init__(self):
        check_fields(self)
        check_shared(self)
        check_options(self.clip_low, self.clip_high, self.kl_beta)


DrGRPOConfig.__doc__ += SHARED_DOCS


class DrGRPO:
    """Mean-centred advantages and a length-unbiased token sum over the fixed completion budget."""

    Config = DrGRPOConfig
    scoring = "trajectory"
    plan_family = "token"  # the plan type `schedule` returns

    def __init__(self, config: DrGRPOConfig):
        self.config = config
        self.kl = KLWeight.of(config)  # the KL weight, moving under a schedule
        self.traits = AlgorithmTraits(reads=TOKEN_READS, needs_reference=self.kl.ever_positive,
                                      has_state=self.kl.dynamic, after_update=self.kl.dynamic,
                                      ground_truth_member=config.ground_truth_member)
        attach_kl_members(self, self.kl)

    def schedule(self, num_steps: int, generator: torch.Generator | None = None) -> TokenPlan:
        return token_plan(num_steps, self.config.ground_truth_member)

    def advantages(self, scores: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
        scores = shaped_scores(scores, self.config)  # [N]: the soft transform when advantage_transform asks
        return group_normalize(scores, group_ids, scale=False)

    def loss(self, new: Score, old_log_prob, advantages, ref: Score | None = None) -> LossOutput:
        """Clipped token surrogate summed over tokens / (n * T), `T` = ``new.log_prob.shape[1]`` (the policy
        scores the full ``num_steps`` budget); arguments as [`~mmgrpo.algorithms.grpo.GRPO.loss`]."""
        c = self.config
        mask = token_mask(new, new.log_prob)  # [n, T]
        log_ratio = new.log_prob - old_log_prob  # [n, T]
        per_token, clipped = clipped_objective(log_ratio, advantages, c.clip_low, c.clip_high)
        policy_loss = aggregate(per_token, mask, "fixed_length")
        metrics = ratio_metrics(log_ratio, mask, clipped, policy_loss)
        loss = add_kl(policy_loss, metrics, new, ref, mask, self.kl(), "fixed_length")
        return LossOutput(loss=loss, metrics=metrics)


PLUGIN = DrGRPO
