"""diffu-GRPO (d1): GRPO on masked-diffusion LMs with the one-step log-prob estimate and random prompt masking.

Paper: https://arxiv.org/abs/2504.12216 (code: dllm-reasoning/d1). The completion is scored in one forward from its
fully masked state, the prompt's tokens masked at random (``pipeline.prompt_mask_prob``, 0.15 in d1) with a fresh mask
per draw; the sampling policy's estimate under the same masks is recorded at rollout time (d1's "old" log-probs). The
policy's ``likelihood`` does the scoring. Loss: per-token clipped ratio over the completion up to its first EOS, plus
``kl_beta`` times the k3 KL to the reference; advantages ``r - mean`` of the group (d1 does not divide by the std).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..plans import MaskedPlan
from ..types import AlgorithmTraits, LossOutput, Score
from ..validation import check_fields, check_range, embedded
from ._limits import DRAWS_LIMIT
from ._masked import TOKEN_STEP_READS, token_step_loss
from . import _options
from ._options import AdvantageOptions, ClipOptions, KLOptions, KLWeight


@dataclass
class DiffuGRPOConfig:
    """Options of [`DiffuGRPO`]: its own and the shared clip, KL and advantage options (written flat, see
    ``mmgrpo show diffu_grpo``) with d1's defaults.

    Args:
        draws (`int`): prompt-mask draws per rollout batch, each a train unit (d1 draws one per inner iteration).
        random_masking (`bool`): a new mask seed every step (d1's default); False reuses one seed.
        clip_low (`float`): the per-token ratio is clipped to ``[1 - clip_low,
            1 + clip_high]`` (d1: 0.5, symmetric).
        kl_beta (`float`): weight of the k3 KL to the reference policy (d1: 0.04).
        scale_rewards (`str`): ``"none"``, d1's (``r - mean`` of the group); ``"group"`` divides by the group's std,
            ``"batch"`` by the batch's.
        adv_std (`str`): that std's estimator with `scale_rewards`: ``"unbiased"`` (n - 1; the std d1's TRL-based code
            computes with PyTorch, and logs, though it does not divide by it) or ``"population"`` (n).
    """

    draws: int = 1
    random_masking: bool = True
    clip: ClipOptions = embedded(ClipOptions, clip_low=0.5)
    kl: KLOptions = embedded(KLOptions, kl_beta=0.04)
    advantage: AdvantageOptions = embedded(AdvantageOptions, scale_rewards="none", adv_std="unbiased")

    def __post_init__(self):
        check_fields(self)
        check_range("draws", self.draws, 1, DRAWS_LIMIT, fix="one estimate per rollout batch is usual")


class DiffuGRPO:
    """diffu-GRPO: one-step likelihood estimate, per-token clipped ratio."""

    Config = DiffuGRPOConfig
    scoring = "likelihood"
    plan_family = "masked"  # the plan type `schedule` returns
    advantages = _options.advantages  # the shared advantage options

    def __init__(self, config: DiffuGRPOConfig):
        self.config = config
        self.kl = KLWeight(config.kl)  # the KL weight, moving under a schedule
        reads = TOKEN_STEP_READS | {"old_token_log_prob"}  # the ratio is per token
        self.traits = AlgorithmTraits(reads=reads, needs_reference=self.kl.ever_positive,
                                      group_local_advantages=config.advantage.group_local)

    def schedule(self, num_steps: int, generator: torch.Generator | None = None) -> MaskedPlan:
        """Every decoding step samples; the units are the likelihood draws ``[[0], [1], ...]``."""
        if self.config.draws > num_steps:
            raise ValueError(f"draws {self.config.draws} must not exceed the {num_steps} decoding steps.")
        seed = int(torch.randint(0, 4096, (1,), generator=generator)) if self.config.random_masking else 42
        return MaskedPlan(
            num_steps=num_steps, train_units=[[j] for j in range(self.config.draws)], scoring="likelihood", seed=seed,
            token_scores=True,
        )

    def loss(self, new: Score, old_log_prob, advantages, ref: Score | None = None) -> LossOutput:
        """Per-token clipped surrogate (+ k3 KL) over the completion, for one draw (see
        [`~mmgrpo.algorithms._masked.token_step_loss`])."""
        return token_step_loss(new, old_log_prob, advantages, ref, clip=self.config.clip, kl_beta=self.kl(),
                               ratio_level="token")


PLUGIN = DiffuGRPO
