"""GSPO: a sequence-level importance ratio (geometric mean of the token ratios), clipped per sequence.

Paper: Group Sequence Policy Optimization, https://arxiv.org/abs/2507.18071. With ``s_i = exp(mean_t log(pi(o_it) /
pi_old(o_it)))`` over the sequence's tokens, the loss of a minibatch is ``mean_i max(-A_i s_i, -A_i clip(s_i, 1 -
eps_low, 1 + eps_high))``; the paper's clip range is 3e-4 / 4e-4 (the ratio is length-normalised, so it stays near 1).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..advantages import StdEstimator, group_normalize
from ..losses import clipped_objective
from ..types import AlgorithmTraits, LossOutput, Score
from ..plans import TokenPlan
from ._token import (
    SHARED_DOCS, AdvantageTransform, KLSchedule, KLWeight, attach_kl_members, check_shared, shaped_scores,
    TOKEN_READS, add_kl, check_options, ratio_metrics, token_mask, token_plan,
)
from ._limits import ADV_EPS_LIMIT
from ..validation import check_fields, check_range


@dataclass
class GSPOConfig:
    """Options of [`GSPO`].

    Args:
        clip_low (`float`), clip_high (`float`): the sequence ratio is clipped to ``[1 - clip_low, 1 + clip_high]``.
        kl_beta (`float`): weight of the k3 KL to the reference (token mean per sequence; the paper uses none: 0).
        adv_eps (`float`): added to the group std.
        adv_std (`str`): the std estimator of the advantages, ``"unbiased"`` (n - 1, TRL's) or ``"population"``.
    """

    clip_low: float = 3e-4
    clip_high: float = 4e-4
    kl_beta: float = 0.0
    kl_schedule: KLSchedule = "constant"
    kl_beta_end: float | None = None
    kl_warmup_steps: int = 0
    adv_eps: float = 1e-4
    adv_std: StdEstimator = "unbiased"
    advantage_transform: AdvantageTransform = "none"
    soft_threshold: float = 0.8
    soft_alpha_high: float = 0.01
    soft_alpha_low: float = 1.0
    ground_truth_member: bool = False

    def __post_init__(self):
        check_fields(self)
        check_shared(self)
        check_options(self.clip_low, self.clip_high, self.kl_beta)
        check_range("adv_eps", self.adv_eps, 0, ADV_EPS_LIMIT, low_open=True, fix="1e-4 is usual")


GSPOConfig.__doc__ += SHARED_DOCS


class GSPO:
    """Sequence-level clipped ratio on group-normalised advantages."""

    Config = GSPOConfig
    scoring = "trajectory"
    plan_family = "token"  # the plan type `schedule` returns

    def __init__(self, config: GSPOConfig):
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
        return group_normalize(scores, group_ids, eps=self.config.adv_eps, std=self.config.adv_std)

    def loss(self, new: Score, old_log_prob, advantages, ref: Score | None = None) -> LossOutput:
        """Clipped sequence surrogate; arguments as [`~mmgrpo.algorithms.grpo.GRPO.loss`]. Metrics are per
        sequence (``ratio_mean`` is the mean sequence ratio)."""
        c = self.config
        mask = token_mask(new, new.log_prob)  # [n, T]
        lengths = mask.sum(dim=1)  # [n]
        seq_log_ratio = ((new.log_prob - old_log_prob) * mask).sum(dim=1) / lengths.clamp_min(1.0)  # [n]
        per_sequence, binds = clipped_objective(seq_log_ratio[:, None], advantages, c.clip_low, c.clip_high)  # [n, 1]
        has_tokens = (lengths > 0).to(per_sequence.dtype)[:, None]  # [n, 1]
        policy_loss = (per_sequence * has_tokens).sum() / has_tokens.sum().clamp_min(1.0)
        metrics = ratio_metrics(seq_log_ratio[:, None], has_tokens, binds, policy_loss)
        loss = add_kl(policy_loss, metrics, new, ref, mask, self.kl(), "sequence_mean")
        return LossOutput(loss=loss, metrics=metrics)


PLUGIN = GSPO
