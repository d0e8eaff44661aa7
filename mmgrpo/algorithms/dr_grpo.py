"""Dr. GRPO: GRPO without the std scaling of advantages and without per-response length normalisation.

Paper: "Understanding R1-Zero-Like Training: A Critical Perspective", https://arxiv.org/abs/2503.20783. Advantages
are ``r - mean_group(r)``; the loss of a minibatch is ``sum_{i,t} max(-A_i r_it, -A_i clip(r_it)) / (n * T)`` with
`T` the fixed maximum completion length (the policy's ``num_steps``), as TRL's ``loss_type="dr_grpo"``.
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
class DrGRPOConfig:
    """Options of [`DrGRPO`]: the shared clip, KL and advantage options (written flat, see ``mmgrpo show dr_grpo``)
    with the paper's defaults.

    Args:
        clip_low (`float`): the token ratio is clipped to ``[1 - clip_low,
            1 + clip_high]`` (0.2, symmetric).
        kl_beta (`float`): weight of the k3 KL to the reference (the paper uses none: 0).
        scale_rewards (`str`): ``"none"``, the paper's: advantages are ``r - mean_group(r)``.
    """

    clip: ClipOptions = embedded(ClipOptions, clip_low=0.2)
    kl: KLOptions = embedded(KLOptions, kl_beta=0.0)
    advantage: AdvantageOptions = embedded(AdvantageOptions, scale_rewards="none")
    ground_truth_member: bool = False
    correction: RolloutCorrectionOptions = embedded(RolloutCorrectionOptions)

    __post_init__ = check_fields  # every check is the fields' own or the shared records'


DrGRPOConfig.__doc__ += GROUND_TRUTH_DOC + CORRECTION_DOC


class DrGRPO:
    """Mean-centred advantages and a length-unbiased token sum over the fixed completion budget."""

    Config = DrGRPOConfig
    scoring = "trajectory"
    plan_family = "token"  # the plan type `schedule` returns
    schedule, advantages = _token.schedule, _options.advantages  # the token plan; the shared advantage options

    def __init__(self, config: DrGRPOConfig):
        self.config = config
        self.kl = KLWeight(config.kl)  # the KL weight, moving under a schedule
        self.traits = token_traits(config, self.kl, rollout_correction=config.correction)

    def loss(self, new: Score, old_log_prob, advantages, ref: Score | None = None) -> LossOutput:
        """Clipped token surrogate summed over tokens / (n * T), `T` = ``new.log_prob.shape[1]`` (the policy
        scores the full ``num_steps`` budget); arguments as [`~mmgrpo.algorithms.grpo.GRPO.loss`]."""
        loss, metrics = clipped_token_loss(new, old_log_prob, advantages, ref, self.config.clip, self.kl(),
                                           "fixed_length")
        return LossOutput(loss=loss, metrics=metrics)


PLUGIN = DrGRPO
