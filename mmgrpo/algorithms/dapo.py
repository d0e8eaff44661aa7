"""DAPO: asymmetric clip-higher, token-level loss aggregation and filtering of groups whose rewards are all equal.

Paper: https://arxiv.org/abs/2503.14476. The loss of an optimizer update is ``sum_{i,t} max(-A_i r_it, -A_i clip(r_it,
1 - eps_low, 1 + eps_high)) / #tokens`` over all the tokens of the update, whatever its number of minibatches (every
token weighs the same, long answers are not down-weighted; TRL's ``loss_type="dapo"``): each minibatch's loss is its
token mean and reports its token count, and the trainer combines them into one token mean
(``traits.update_mean = "entries"``). Advantages divide by the group's unbiased std (n - 1), as TRL.

Group filtering (``filter_groups``, the paper's dynamic sampling without the re-sampling): a group whose rewards are
all equal has advantage exactly 0 for every member, so its samples carry no policy gradient; with filtering their
tokens are also left out of the token count (and of the KL term), so they do not dilute the other groups' gradient.
Every sample with advantage exactly 0 is left out this way. Over-long reward shaping belongs to the reward.
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
    TOKEN_READS, add_kl, aggregate, check_options, ratio_metrics, token_mask, token_plan,
)
from ._limits import ADV_EPS_LIMIT
from ..validation import check_fields, check_range


@dataclass
class DAPOConfig:
    """Options of [`DAPO`].

    Args:
        clip_low (`float`), clip_high (`float`): the token ratio is clipped to ``[1 - clip_low, 1 + clip_high]``;
            the paper's clip-higher is 0.2 / 0.28.
        filter_groups (`bool`): leave samples with zero advantage (all-equal groups) out of the token count.
        kl_beta (`float`): weight of the k3 KL to the reference (the paper removes it: 0).
        adv_eps (`float`): added to the group std.
        adv_std (`str`): the std estimator of the advantages, ``"unbiased"`` (n - 1, TRL's) or ``"population"``.
    """

    clip_low: float = 0.2
    clip_high: float = 0.28
    filter_groups: bool = True
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


DAPOConfig.__doc__ += SHARED_DOCS


class DAPO:
    """Clip-higher, token-mean aggregation, zero-advantage groups filtered out of the token count."""

    Config = DAPOConfig
    scoring = "trajectory"
    plan_family = "token"  # the plan type `schedule` returns

    def __init__(self, config: DAPOConfig):
        self.config = config
        self.kl = KLWeight.of(config)  # the KL weight, moving under a schedule
        self.traits = AlgorithmTraits(reads=TOKEN_READS, needs_reference=self.kl.ever_positive, update_mean="entries",
                                      has_state=self.kl.dynamic, after_update=self.kl.dynamic,
                                      ground_truth_member=config.ground_truth_member)
        attach_kl_members(self, self.kl)

    def schedule(self, num_steps: int, generator: torch.Generator | None = None) -> TokenPlan:
        return token_plan(num_steps, self.config.ground_truth_member)

    def advantages(self, scores: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
        scores = shaped_scores(scores, self.config)  # [N]: the soft transform when advantage_transform asks
        return group_normalize(scores, group_ids, eps=self.config.adv_eps, std=self.config.adv_std)

    def loss(self, new: Score, old_log_prob, advantages, ref: Score | None = None) -> LossOutput:
        """Clipped token surrogate averaged over the kept tokens, their count as ``entries`` (the trainer makes the
        update's loss one token mean over its minibatches); arguments as [`~mmgrpo.algorithms.grpo.GRPO.loss`]."""
        c = self.config
        mask = token_mask(new, new.log_prob)  # [n, T]
        if c.filter_groups:
            mask = mask * (advantages != 0).to(mask.dtype)[:, None]
        log_ratio = new.log_prob - old_log_prob  # [n, T]
        per_token, clipped = clipped_objective(log_ratio, advantages, c.clip_low, c.clip_high)
        policy_loss = aggregate(per_token, mask, "token_mean")
        metrics = ratio_metrics(log_ratio, mask, clipped, policy_loss)
        metrics["kept_fraction"] = float((advantages != 0).float().mean()) if c.filter_groups else 1.0
        loss = add_kl(policy_loss, metrics, new, ref, mask, self.kl(), "token_mean")
        return LossOutput(loss=loss, metrics=metrics, entries=float(mask.sum()))


PLUGIN = DAPO
