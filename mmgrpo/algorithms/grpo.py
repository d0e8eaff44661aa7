"""GRPO: group mean/std advantages, clipped per-token ratio, k3 KL to the reference (token-level policies).

Paper: DeepSeekMath, https://arxiv.org/abs/2402.03300 (Group Relative Policy Optimization). The loss of a minibatch
is ``mean_i 1/|o_i| sum_t [max(-A_i r_it, -A_i clip(r_it, 1 - eps_low, 1 + eps_high)) + beta * KL3_it]`` with
``r_it = pi(o_it) / pi_old(o_it)`` and ``KL3 = exp(ref - new) - (ref - new) - 1`` (per-sequence mean of the
tokens, then mean over sequences, as the paper and TRL's ``loss_type="grpo"``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..types import LossOutput, Score
from ..validation import check_fields, embedded
from . import _options, _token
from ._options import AdvantageOptions, ClipOptions, KLOptions, KLWeight, RolloutCorrectionOptions
from ._token import CORRECTION_DOC, GROUND_TRUTH_DOC, clipped_token_loss, token_traits


@dataclass
class GRPOConfig:
    """Options of [`GRPO`]: the shared clip, KL and advantage options (written flat, see ``mmgrpo show grpo``) with
    TRL's defaults.

    Args:
        clip_low (`float`): the token ratio is clipped to ``[1 - clip_low,
            1 + clip_high]``; TRL's 0.2, symmetric.
        kl_beta (`float`): weight of the k3 KL to the reference (0 skips the reference forward). The paper's 0.04.
        adv_std (`str`): the std estimator of the advantages, ``"unbiased"`` (n - 1, TRL's) or ``"population"``.
    """

    clip: ClipOptions = embedded(ClipOptions, clip_low=0.2)
    kl: KLOptions = embedded(KLOptions, kl_beta=0.04)
    advantage: AdvantageOptions = embedded(AdvantageOptions, scale_rewards="group", adv_std="unbiased", adv_eps=1e-4)
    ground_truth_member: bool = False
    correction: RolloutCorrectionOptions = embedded(RolloutCorrectionOptions)

    __post_init__ = check_fields  # every check is the fields' own or the shared records'


GRPOConfig.__doc__ += GROUND_TRUTH_DOC + CORRECTION_DOC


class GRPO:
    """GRPO on per-token log-probs; the whole completion is one trained unit (see `_token.token_plan`)."""

    Config = GRPOConfig
    scoring = "trajectory"
    plan_family = "token"  # the plan type `schedule` returns
    schedule, advantages = _token.schedule, _options.advantages  # the token plan; the shared advantage options

    def __init__(self, config: GRPOConfig):
        self.config = config
        self.kl = KLWeight(config.kl)  # the KL weight, moving under a schedule
        self.traits = token_traits(config, self.kl, rollout_correction=config.correction)

    def loss(self, new: Score, old_log_prob, advantages, ref: Score | None = None) -> LossOutput:
        """Clipped token surrogate plus ``kl_beta`` times the k3 KL, per-sequence token means, then their mean.

        Args:
            new ([`Score`]): ``log_prob`` `[n, T]` with gradients and ``mask`` `[n, T]` (scored tokens).
            old_log_prob (`torch.FloatTensor` of shape `[n, T]`): log-probs recorded at sampling.
            advantages (`torch.FloatTensor` of shape `[n]`).
            ref ([`Score`], *optional*): the reference policy's ``log_prob`` `[n, T]`.
        """
        loss, metrics = clipped_token_loss(new, old_log_prob, advantages, ref, self.config.clip, self.kl(),
                                           "sequence_mean")
        return LossOutput(loss=loss, metrics=metrics)


PLUGIN = GRPO
