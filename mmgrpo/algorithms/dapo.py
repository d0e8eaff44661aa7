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

from ..plans import TokenPlan
from ..types import LossOutput, Score
from ..validation import check_fields, embedded
from ._options import AdvantageOptions, ClipOptions, KLOptions, KLWeight
from ._token import GROUND_TRUTH_DOC, clipped_token_loss, token_mask, token_plan, token_traits


@dataclass
class DAPOConfig:
    """Options of [`DAPO`]: its own and the shared clip, KL and advantage options (written flat, see
    ``mmgrpo show dapo``) with the paper's and TRL's defaults.

    Args:
        filter_groups (`bool`): leave samples with zero advantage (all-equal groups) out of the token count.
        clip_low (`float`): the token ratio is clipped to ``[1 - clip_low, 1 + clip_high]``; the paper's clip-higher
            is 0.2 / 0.28.
        kl_beta (`float`): weight of the k3 KL to the reference (the paper removes it: 0).
        adv_std (`str`): the std estimator of the advantages, ``"unbiased"`` (n - 1, TRL's) or ``"population"``.
    """

    filter_groups: bool = True
    clip: ClipOptions = embedded(ClipOptions, clip_low=0.2, clip_high=0.28)
    kl: KLOptions = embedded(KLOptions, kl_beta=0.0)
    advantage: AdvantageOptions = embedded(AdvantageOptions, scale_rewards="group", adv_std="unbiased", adv_eps=1e-4)
    ground_truth_member: bool = False

    def __post_init__(self):
        check_fields(self)


DAPOConfig.__doc__ += GROUND_TRUTH_DOC


class DAPO:
    """Clip-higher, token-mean aggregation, zero-advantage groups filtered out of the token count."""

    Config = DAPOConfig
    scoring = "trajectory"
    plan_family = "token"  # the plan type `schedule` returns

    def __init__(self, config: DAPOConfig):
        self.config = config
        self.kl = KLWeight(config.kl)  # the KL weight, moving under a schedule
        self.traits = token_traits(config, self.kl, update_mean="entries")

    def schedule(self, num_steps: int, generator: torch.Generator | None = None) -> TokenPlan:
        return token_plan(num_steps, self.config.ground_truth_member)

    def advantages(self, scores: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
        return self.config.advantage.compute(scores, group_ids)

    def loss(self, new: Score, old_log_prob, advantages, ref: Score | None = None) -> LossOutput:
        """Clipped token surrogate averaged over the kept tokens, their count as ``entries`` (the trainer makes the
        update's loss one token mean over its minibatches); arguments as [`~mmgrpo.algorithms.grpo.GRPO.loss`]."""
        mask = token_mask(new, new.log_prob)  # [n, T]
        if self.config.filter_groups:
            mask = mask * (advantages != 0).to(mask.dtype)[:, None]
        loss, metrics = clipped_token_loss(new, old_log_prob, advantages, ref, self.config.clip, self.kl(),
                                           "token_mean", mask)
        metrics["kept_fraction"] = float((advantages != 0).float().mean()) if self.config.filter_groups else 1.0
        return LossOutput(loss=loss, metrics=metrics, entries=float(mask.sum()))


PLUGIN = DAPO
