"""Dr. GRPO: GRPO without the std scaling of advantages and without per-response length normalisation.

Paper: "Understanding R1-Zero-Like Training: A Critical Perspective", https://arxiv.org/abs/2503.20783. Advantages
are ``r - mean_group(r)``; the loss of a minibatch is ``sum_{i,t} max(-A_i r_it, -A_i clip(r_it)) / (n * T)`` with
`T` the fixed maximum completion length (the policy's ``num_steps``), as TRL's ``loss_type="dr_grpo"``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..plans import TokenPlan
from ..types import LossOutput, Score
from ..validation import check_fields, embedded
from ._options import AdvantageOptions, ClipOptions, KLOptions, KLWeight
from ._token import GROUND_TRUTH_DOC, clipped_token_loss, token_plan, token_traits


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

    def __post_init__(self):
        check_fields(self)


DrGRPOConfig.__doc__ += GROUND_TRUTH_DOC


class DrGRPO:
    """Mean-centred advantages and a length-unbiased token sum over the fixed completion budget."""

    Config = DrGRPOConfig
    scoring = "trajectory"
    plan_family = "token"  # the plan type `schedule` returns

    def __init__(self, config: DrGRPOConfig):
        self.config = config
        self.kl = KLWeight(config.kl)  # the KL weight, moving under a schedule
        self.traits = token_traits(config, self.kl)

    def schedule(self, num_steps: int, generator: torch.Generator | None = None) -> TokenPlan:
        return token_plan(num_steps, self.config.ground_truth_member)

    def advantages(self, scores: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
        return self.config.advantage.compute(scores, group_ids)

    def loss(self, new: Score, old_log_prob, advantages, ref: Score | None = None) -> LossOutput:
        """Clipped token surrogate summed over tokens / (n * T), `T` = ``new.log_prob.shape[1]`` (the policy
        scores the full ``num_steps`` budget); arguments as [`~mmgrpo.algorithms.grpo.GRPO.loss`]."""
        loss, metrics = clipped_token_loss(new, old_log_prob, advantages, ref, self.config.clip, self.kl(),
                                           "fixed_length")
        return LossOutput(loss=loss, metrics=metrics)


PLUGIN = DrGRPO
