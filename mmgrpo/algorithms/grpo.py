"""GRPO: group mean/std advantages, clipped per-token ratio, k3 KL to the reference (token-level policies).

Paper: DeepSeekMath, https://arxiv.org/abs/2402.03300 (Group Relative Policy Optimization). The loss of a minibatch
is ``mean_i 1/|o_i| sum_t [max(-A_i r_it, -A_i clip(r_it, 1 - eps_low, 1 + eps_high)) + beta * KL3_it]`` with
``r_it = pi(o_it) / pi_old(o_it)`` and ``KL3 = exp(ref - new) - (ref - new) - 1`` (per-sequence mean of the
tokens, then mean over sequences, as the paper and TRL's ``loss_type="grpo"``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from ..advantages import StdEstimator, group_normalize
from ..losses import clipped_objective
from ..types import AlgorithmTraits, LossOutput, Score
from ..plans import TokenPlan
from ._token import (
    SHARED_DOCS, AdvantageTransform, KLSchedule, KLWeight, attach_kl_members, check_shared, shaped_scores,
    TOKEN_READS, add_kl, check_options, aggregate, ratio_metrics, token_mask, token_plan,
)
from ._limits import ADV_EPS_LIMIT
from ..validation import check_fields, check_range


@dataclass
class GRPOConfig:
    """Options of [`GRPO`].

    Args:
        clip_low (`float`), clip_high (`float`): the token ratio is clipped to ``[1 - clip_low, 1 + clip_high]``.
        kl_beta (`float`): weight of the k3 KL to the reference (0 skips the reference forward). The paper's 0.04.
        scale_rewards (`str`): ``"group"`` divides by the group's std, ``"batch"`` by the batch's, ``"none"`` not.
        adv_eps (`float`): added to the std.
        adv_std (`str`): the std estimator of the advantages, ``"unbiased"`` (n - 1, TRL's) or ``"population"``.
    """

    clip_low: float = 0.2
    clip_high: float = 0.2
    kl_beta: float = 0.04
    kl_schedule: KLSchedule = "constant"
    kl_beta_end: float | None = None
    kl_warmup_steps: int = 0
    scale_rewards: Literal["group", "batch", "none"] = "group"
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
        if self.scale_rewards not in ("group", "batch", "none"):
            raise ValueError(f"scale_rewards must be 'group', 'batch' or 'none', got {self.scale_rewards!r}.")


GRPOConfig.__doc__ += SHARED_DOCS


class GRPO:
    """GRPO on per-token log-probs; the whole completion is one trained unit (see `_token.token_plan`)."""

    Config = GRPOConfig
    scoring = "trajectory"
    plan_family = "token"  # the plan type `schedule` returns

    def __init__(self, config: GRPOConfig):
        self.config = config
        self.kl = KLWeight.of(config)  # the KL weight, moving under a schedule
        self.traits = AlgorithmTraits(reads=TOKEN_READS, needs_reference=self.kl.ever_positive,
                                      has_state=self.kl.dynamic, after_update=self.kl.dynamic,
                                      ground_truth_member=config.ground_truth_member,
                                      group_local_advantages=config.scale_rewards != "batch")
        attach_kl_members(self, self.kl)

    def schedule(self, num_steps: int, generator: torch.Generator | None = None) -> TokenPlan:
        return token_plan(num_steps, self.config.ground_truth_member)

    def advantages(self, scores: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
        c = self.config
        scores = shaped_scores(scores, self.config)  # [N]: the soft transform when advantage_transform asks
        return group_normalize(scores, group_ids, scale=c.scale_rewards != "none", global_std=c.scale_rewards == "batch",
                               eps=c.adv_eps, std=c.adv_std)

    def loss(self, new: Score, old_log_prob, advantages, ref: Score | None = None) -> LossOutput:
        """Clipped token surrogate plus ``kl_beta`` times the k3 KL.

        Args:
            new ([`Score`]): ``log_prob`` `[n, T]` with gradients and ``mask`` `[n, T]` (scored tokens).
            old_log_prob (`torch.FloatTensor` of shape `[n, T]`): log-probs recorded at sampling.
            advantages (`torch.FloatTensor` of shape `[n]`).
            ref ([`Score`], *optional*): the reference policy's ``log_prob`` `[n, T]`.
        """
        c = self.config
        mask = token_mask(new, new.log_prob)  # [n, T]
        log_ratio = new.log_prob - old_log_prob  # [n, T]
        per_token, clipped = clipped_objective(log_ratio, advantages, c.clip_low, c.clip_high)
        policy_loss = aggregate(per_token, mask, "sequence_mean")
        metrics = ratio_metrics(log_ratio, mask, clipped, policy_loss)
        loss = add_kl(policy_loss, metrics, new, ref, mask, self.kl(), "sequence_mean")
        return LossOutput(loss=loss, metrics=metrics)


PLUGIN = GRPO
