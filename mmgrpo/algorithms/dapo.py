"""DAPO: asymmetric clip-higher and a token-level loss, every token of the rollout batch weighing the same.

Paper: https://arxiv.org/abs/2503.14476. The loss is ``sum_{i,t} max(-A_i r_it, -A_i clip(r_it, 1 - eps_low,
1 + eps_high)) / #tokens`` (long answers are not down-weighted). ``token_mean`` says which tokens are counted:

- ``"rollout"`` (default; TRL's ``GRPOTrainer(loss_type="dapo")`` exactly): every optimizer update divides its token
  sum by the token count of the whole rollout batch (all its samples, zero-advantage groups included, over every
  process, divided by the number of processes), so with ``train.updates_per_step`` k each update weighs its share of
  the batch's tokens (TRL's ``steps_per_generation = k * gradient_accumulation_steps``). With one update per rollout
  batch it is the update's own token mean. The trainer does it (``traits.update_mean = "rollout_entries"``): the
  count is the rollout's scored tokens (``Rollout.mask``), samples without a finite reward included as TRL counts
  them.
- ``"update"``: each update divides by its own tokens (over its minibatches and the processes).
- ``"update_with_signal"``: as ``"update"``, but samples with advantage exactly 0 (all-equal groups) are left out of
  the count and of the KL term, so they do not dilute the other groups' gradient. The paper's dynamic sampling instead
  re-samples such groups until the batch holds only groups with signal, which mmgrpo does not do; this is a stand-in.

Advantages divide by the group's unbiased std (n - 1) + 1e-4, as TRL. Over-long reward shaping belongs to the reward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from ..types import LossOutput, Score
from ..validation import check_fields, embedded
from . import _options, _token
from ._options import AdvantageOptions, ClipOptions, KLOptions, KLWeight, RolloutCorrectionOptions
from ._token import CORRECTION_DOC, GROUND_TRUTH_DOC, clipped_token_loss, token_mask, token_traits

UPDATE_MEANS = {"rollout": "rollout_entries", "update": "entries", "update_with_signal": "entries"}


@dataclass
class DAPOConfig:
    """Options of [`DAPO`]: its own and the shared clip, KL and advantage options (written flat, see
    ``mmgrpo show dapo``) with the paper's and TRL's defaults.

    Args:
        token_mean (`str`): the tokens each update's token sum is divided by: ``"rollout"`` (TRL's), ``"update"`` or
            ``"update_with_signal"`` (see the module docstring).
        clip_low (`float`): the token ratio is clipped to ``[1 - clip_low,
            1 + clip_high]``; the paper's clip-higher is 0.2 / 0.28.
        kl_beta (`float`): weight of the k3 KL to the reference (the paper removes it: 0).
        adv_std (`str`): the std estimator of the advantages, ``"unbiased"`` (n - 1, TRL's) or ``"population"``.
    """

    token_mean: Literal["rollout", "update", "update_with_signal"] = "rollout"
    clip: ClipOptions = embedded(ClipOptions, clip_low=0.2, clip_high=0.28)
    kl: KLOptions = embedded(KLOptions, kl_beta=0.0)
    advantage: AdvantageOptions = embedded(AdvantageOptions, scale_rewards="group", adv_std="unbiased", adv_eps=1e-4)
    ground_truth_member: bool = False
    correction: RolloutCorrectionOptions = embedded(RolloutCorrectionOptions)

    __post_init__ = check_fields  # every check is the fields' own or the shared records'


DAPOConfig.__doc__ += GROUND_TRUTH_DOC + CORRECTION_DOC


class DAPO:
    """Clip-higher and a token mean over the rollout batch (TRL's), its update, or its samples with signal."""

    Config = DAPOConfig
    scoring = "trajectory"
    plan_family = "token"  # the plan type `schedule` returns
    schedule, advantages = _token.schedule, _options.advantages  # the token plan; the shared advantage options

    def __init__(self, config: DAPOConfig):
        self.config = config
        self.kl = KLWeight(config.kl)  # the KL weight, moving under a schedule
        self.traits = token_traits(config, self.kl, update_mean=UPDATE_MEANS[config.token_mean],
                                   rollout_correction=config.correction)

    def loss(self, new: Score, old_log_prob, advantages, ref: Score | None = None) -> LossOutput:
        """Clipped token surrogate averaged over the counted tokens, their number as ``entries`` (the trainer makes
        the update's loss one token mean, see the module docstring); arguments as
        [`~mmgrpo.algorithms.grpo.GRPO.loss`]."""
        mask = token_mask(new, new.log_prob)  # [n, T]
        with_signal = self.config.token_mean == "update_with_signal"
        if with_signal:
            mask = mask * (advantages != 0).to(mask.dtype)[:, None]
        loss, metrics = clipped_token_loss(new, old_log_prob, advantages, ref, self.config.clip, self.kl(),
                                           "token_mean", mask)
        metrics["kept_fraction"] = float((advantages != 0).float().mean()) if with_signal else 1.0
        return LossOutput(loss=loss, metrics=metrics, entries=float(mask.sum()))


PLUGIN = DAPO
