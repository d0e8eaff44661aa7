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

from ..advantages import StdEstimator, group_normalize
from ..types import AlgorithmTraits, LossOutput, Score
from ..plans import MaskedPlan
from ._limits import ADV_CLIP_LIMIT, CLIP_LIMIT, KL_BETA_LIMIT
from ..validation import check_fields, check_range
from ._masked import TOKEN_STEP_READS, token_step_loss


@dataclass
class CJGRPOConfig:
    """Options of [`CJGRPO`].

    Args:
        clip_low (`float`): the ratio is clipped to ``[1 - clip_low, 1 + clip_high]`` (authors: 0.5).
        clip_high (`float`, *optional*): unset: `clip_low` (a symmetric clip).
        kl_beta (`float`): weight of the k3 KL to the reference policy (authors: 0.04; 0 skips the reference).
        ratio_level (`str`): ``"token"`` or ``"step"`` (see the module docstring).
        scale_rewards (`str`): ``"group"`` divides the centred rewards by the group's std, ``"batch"`` by the batch's,
            ``"none"`` not (the authors' code; default).
        adv_std (`str`): that std's estimator with `scale_rewards`: ``"unbiased"`` (n - 1; the std the authors' d1-based
            code computes with PyTorch, and logs, though it does not divide by it) or ``"population"`` (n).
        adv_clip_max (`float`, *optional*): clamp advantages to ``[-adv_clip_max, adv_clip_max]``.
    """

    clip_low: float = 0.5
    clip_high: float | None = None
    kl_beta: float = 0.04
    ratio_level: Literal["token", "step"] = "token"
    scale_rewards: Literal["group", "batch", "none"] = "none"
    adv_std: StdEstimator = "unbiased"
    adv_clip_max: float | None = None

    def __post_init__(self):
        check_fields(self)
        if self.adv_clip_max is not None:
            check_range("adv_clip_max", self.adv_clip_max, 0, ADV_CLIP_LIMIT, low_open=True)
        check_range("kl_beta", self.kl_beta, high=KL_BETA_LIMIT, fix="0 turns the KL term off")
        for key, clip in (("clip_low", self.clip_low), ("clip_high", self.clip_high)):
            if clip is not None:
                check_range(key, clip, high=CLIP_LIMIT, fix="the ratio is clipped to [1 - clip_low, 1 + clip_high]")
        if self.clip_low <= 0 or (self.clip_high is not None and self.clip_high <= 0):
            raise ValueError(f"clip_low and clip_high must be > 0, got {self.clip_low}, {self.clip_high}.")
        if self.kl_beta < 0:
            raise ValueError(f"kl_beta must be >= 0, got {self.kl_beta}.")


class CJGRPO:
    """CJ-GRPO: every decoding step is a train unit, replayed exactly and clipped per step."""

    Config = CJGRPOConfig
    scoring = "trajectory"
    plan_family = "masked"  # the plan type `schedule` returns

    def __init__(self, config: CJGRPOConfig):
        self.config = config
        token_ratio = {"old_token_log_prob"} if config.ratio_level == "token" else set()
        self.traits = AlgorithmTraits(reads=TOKEN_STEP_READS | token_ratio, needs_reference=config.kl_beta > 0,
                                      group_local_advantages=config.scale_rewards != "batch")

    def schedule(self, num_steps: int, generator: torch.Generator | None = None) -> MaskedPlan:
        """Every decoding step samples and is trained, one step per unit."""
        steps = list(range(num_steps))
        return MaskedPlan(num_steps=num_steps, train_units=[[s] for s in steps], token_scores=True)

    def advantages(self, scores: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
        c = self.config
        return group_normalize(scores, group_ids, scale=c.scale_rewards != "none",
                               global_std=c.scale_rewards == "batch", clip=c.adv_clip_max, std=c.adv_std)

    def loss(self, new: Score, old_log_prob, advantages, ref: Score | None = None) -> LossOutput:
        """Clipped surrogate of one decoding step (see [`token_step_loss`]).

        Args:
            new ([`Score`]): the policy's replay of the step (``log_prob`` `[n, k]`, ``token_log_prob`` `[n, k, L]`...).
            old_log_prob (`torch.FloatTensor` of shape `[n, k]`): the step's log-prob recorded at sampling.
            advantages (`torch.FloatTensor` of shape `[n]`).
            ref ([`Score`], *optional*): the reference policy's replay (``token_log_prob``) for the KL term.
        """
        c = self.config
        high = c.clip_low if c.clip_high is None else c.clip_high
        return token_step_loss(new, old_log_prob, advantages, ref, clip_low=c.clip_low, clip_high=high,
                               kl_beta=c.kl_beta, ratio_level=c.ratio_level)


PLUGIN = CJGRPO
