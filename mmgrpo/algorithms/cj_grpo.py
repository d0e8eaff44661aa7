"""CJ-GRPO: clipped policy gradient on every masked-diffusion decoding step, replayed on the exact rollout states.

Paper: https://arxiv.org/abs/2509.23924 (code: yjyddq/EOSER-ASS-RL). The pipeline records the step at which each
completion token was committed; every decoding step is a train unit, so the trainer rebuilds that step's state,
scores the tokens committed there and back-propagates one step at a time (memory does not grow with the number of
steps). Decoding (blocks, EOSER, ASS) is configured on the pipeline. The step loss is the clipped surrogate with either
the per-token ratio averaged over the step's tokens (``ratio_level="token"``, the authors' code) or the ratio of the
whole transition, the product of its tokens' probabilities (``"step"``, the paper's ``p(x_s | x_{s-1})``), plus
``kl_beta`` times the k3 KL to the reference (adapter disabled) on the step's tokens. Advantages are ``r - mean`` of the
group (the authors' code), or z-scores with ``scale_rewards="group"`` (their Algorithm 1).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from ..plans import MaskedPlan
from ..types import AlgorithmTraits, LossOutput, Score
from ..validation import check_fields, embedded
from ._masked import TOKEN_STEP_READS, token_step_loss
from . import _options
from ._options import AdvantageOptions, ClipOptions, KLOptions, KLWeight


@dataclass
class CJGRPOConfig:
    """Options of [`CJGRPO`]: its own and the shared clip, KL and advantage options (written flat, see
    ``mmgrpo show cj_grpo``) with the authors' defaults.

    Args:
        ratio_level (`str`): ``"token"`` or ``"step"`` (see the module docstring).
        clip_low (`float`): the ratio is clipped to ``[1 - clip_low, 1 + clip_high]``
            (authors: 0.5, symmetric).
        kl_beta (`float`): weight of the k3 KL to the reference policy (authors: 0.04; 0 skips the reference).
        scale_rewards (`str`): ``"none"``, the authors' code (``r - mean`` of the group); ``"group"`` divides by the
            group's std (their Algorithm 1), ``"batch"`` by the batch's.
        adv_std (`str`): that std's estimator with `scale_rewards`: ``"unbiased"`` (n - 1; the std the authors' d1-based
            code computes with PyTorch, and logs, though it does not divide by it) or ``"population"`` (n).
    """

    ratio_level: Literal["token", "step"] = "token"
    clip: ClipOptions = embedded(ClipOptions, clip_low=0.5)
    kl: KLOptions = embedded(KLOptions, kl_beta=0.04)
    advantage: AdvantageOptions = embedded(AdvantageOptions, scale_rewards="none", adv_std="unbiased")

    def __post_init__(self):
        check_fields(self)


class CJGRPO:
    """CJ-GRPO: every decoding step is a train unit, replayed exactly and clipped per step."""

    Config = CJGRPOConfig
    scoring = "trajectory"
    plan_family = "masked"  # the plan type `schedule` returns
    advantages = _options.advantages  # the shared advantage options

    def __init__(self, config: CJGRPOConfig):
        self.config = config
        self.kl = KLWeight(config.kl)  # the KL weight, moving under a schedule
        token_ratio = {"old_token_log_prob"} if config.ratio_level == "token" else set()
        self.traits = AlgorithmTraits(reads=TOKEN_STEP_READS | token_ratio, needs_reference=self.kl.ever_positive,
                                      group_local_advantages=config.advantage.group_local)

    def schedule(self, num_steps: int, generator: torch.Generator | None = None) -> MaskedPlan:
        """Every decoding step samples and is trained, one step per unit."""
        steps = list(range(num_steps))
        return MaskedPlan(num_steps=num_steps, train_units=[[s] for s in steps], token_scores=True)

    def loss(self, new: Score, old_log_prob, advantages, ref: Score | None = None) -> LossOutput:
        """Clipped surrogate of one decoding step (see [`token_step_loss`]).

        Args:
            new ([`Score`]): the policy's replay of the step (``log_prob`` `[n, k]`, ``token_log_prob`` `[n, k, L]`...).
            old_log_prob (`torch.FloatTensor` of shape `[n, k]`): the step's log-prob recorded at sampling.
            advantages (`torch.FloatTensor` of shape `[n]`).
            ref ([`Score`], *optional*): the reference policy's replay (``token_log_prob``) for the KL term.
        """
        return token_step_loss(new, old_log_prob, advantages, ref, clip=self.config.clip, kl_beta=self.kl(),
                               ratio_level=self.config.ratio_level)


PLUGIN = CJGRPO
