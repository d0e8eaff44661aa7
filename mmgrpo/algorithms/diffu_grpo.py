"""diffu-GRPO (d1): GRPO on masked-diffusion LMs with the one-step log-prob estimate and random prompt masking.

Paper: https://arxiv.org/abs/2504.12216 (code: dllm-reasoning/d1). The completion is scored in one forward from its
fully masked state, the prompt's tokens masked at random (``pipeline.prompt_mask_prob``, 0.15 in d1) with a fresh mask
per draw; the sampling policy's estimate under the same masks is recorded at rollout time (d1's "old" log-probs). The
policy's ``likelihood`` does the scoring. Loss: per-token clipped ratio over the completion up to its first EOS, plus
``kl_beta`` times the k3 KL to the reference; advantages ``r - mean`` of the group (d1 does not divide by the std).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from ..advantages import StdEstimator, group_normalize
from ..types import AlgorithmTraits, LossOutput, Score
from ..plans import MaskedPlan
from ._masked import TOKEN_STEP_READS, token_step_loss
from ._limits import CLIP_LIMIT, DRAWS_LIMIT, KL_BETA_LIMIT
from ..validation import check_fields, check_range


@dataclass
class DiffuGRPOConfig:
    """Options of [`DiffuGRPO`].

    Args:
        draws (`int`): prompt-mask draws per rollout batch, each a train unit (d1 draws one per inner iteration).
        random_masking (`bool`): a new mask seed every step (d1's default); False reuses one seed.
        clip_low (`float`): the per-token ratio is clipped to ``[1 - clip_low, 1 + clip_high]`` (d1: 0.5).
        clip_high (`float`, *optional*): unset: `clip_low` (a symmetric clip, d1's).
        kl_beta (`float`): weight of the k3 KL to the reference policy (d1: 0.04).
        scale_rewards (`str`): ``"group"`` divides the centred rewards by the group's std, ``"batch"`` by the batch's,
            ``"none"`` not (d1; default).
        adv_std (`str`): that std's estimator with `scale_rewards`: ``"unbiased"`` (n - 1; the std d1's TRL-based code
            computes with PyTorch, and logs, though it does not divide by it) or ``"population"`` (n).
    """

    draws: int = 1
    random_masking: bool = True
    clip_low: float = 0.5
    clip_high: float | None = None
    kl_beta: float = 0.04
    scale_rewards: Literal["group", "batch", "none"] = "none"
    adv_std: StdEstimator = "unbiased"

    def __post_init__(self):
        check_fields(self)
        check_range("draws", self.draws, high=DRAWS_LIMIT, fix="one estimate per rollout batch is usual")
        check_range("kl_beta", self.kl_beta, high=KL_BETA_LIMIT, fix="0 turns the KL term off")
        for key, clip in (("clip_low", self.clip_low), ("clip_high", self.clip_high)):
            if clip is not None:
                check_range(key, clip, high=CLIP_LIMIT, fix="the ratio is clipped to [1 - clip_low, 1 + clip_high]")
        if self.draws < 1:
            raise ValueError(f"draws must be >= 1, got {self.draws}.")
        if self.clip_low <= 0 or (self.clip_high is not None and self.clip_high <= 0) or self.kl_beta < 0:
            raise ValueError(f"need clip_low, clip_high > 0 and kl_beta >= 0, got {self.clip_low}, {self.clip_high}, "
                             f"{self.kl_beta}.")


class DiffuGRPO:
    """diffu-GRPO: one-step likelihood estimate, per-token clipped ratio."""

    Config = DiffuGRPOConfig
    scoring = "likelihood"
    plan_family = "masked"  # the plan type `schedule` returns

    def __init__(self, config: DiffuGRPOConfig):
        self.config = config
        reads = TOKEN_STEP_READS | {"old_token_log_prob"}  # the ratio is per token
        self.traits = AlgorithmTraits(reads=reads, needs_reference=config.kl_beta > 0,
                                      group_local_advantages=config.scale_rewards != "batch")

    def schedule(self, num_steps: int, generator: torch.Generator | None = None) -> MaskedPlan:
        """Every decoding step samples; the units are the likelihood draws ``[[0], [1], ...]``."""
        if self.config.draws > num_steps:
            raise ValueError(f"draws {self.config.draws} must not exceed the {num_steps} decoding steps.")
        seed = int(torch.randint(0, 4096, (1,), generator=generator)) if self.config.random_masking else 42
        return MaskedPlan(
            num_steps=num_steps, train_units=[[j] for j in range(self.config.draws)], scoring="likelihood", seed=seed,
            token_scores=True,
        )

    def advantages(self, scores: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
        c = self.config
        return group_normalize(scores, group_ids, scale=c.scale_rewards != "none",
                               global_std=c.scale_rewards == "batch", std=c.adv_std)

    def loss(self, new: Score, old_log_prob, advantages, ref: Score | None = None) -> LossOutput:
        """Per-token clipped surrogate (+ k3 KL) over the completion, for one draw (see
        [`~mmgrpo.algorithms._masked.token_step_loss`])."""
        c = self.config
        return token_step_loss(new, old_log_prob, advantages, ref, clip_low=c.clip_low,
                               clip_high=c.clip_low if c.clip_high is None else c.clip_high,
                               kl_beta=c.kl_beta, ratio_level="token")


PLUGIN = DiffuGRPO
