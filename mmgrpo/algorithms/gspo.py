"""GSPO: a sequence-level importance ratio (geometric mean of the token ratios), clipped per sequence.

Paper: Group Sequence Policy Optimization, https://arxiv.org/abs/2507.18071. With ``s_i = exp(mean_t log(pi(o_it) /
pi_old(o_it)))`` over the sequence's tokens, the loss of a minibatch is ``mean_i max(-A_i s_i, -A_i clip(s_i, 1 -
eps_low, 1 + eps_high))``; the paper's clip range is 3e-4 / 4e-4 (the ratio is length-normalised, so it stays near 1).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..losses import clipped_objective
from ..types import LossOutput, Score
from ..validation import check_fields, embedded
from . import _options, _token
from ._options import AdvantageOptions, ClipOptions, KLOptions, KLWeight
from ._token import GROUND_TRUTH_DOC, add_kl, ratio_metrics, token_mask, token_traits


@dataclass
class GSPOConfig:
    """Options of [`GSPO`]: the shared clip, KL and advantage options (written flat, see ``mmgrpo show gspo``) with
    the paper's defaults.

    Args:
        clip_low (`float`): the sequence ratio is clipped to ``[1 - clip_low,
            1 + clip_high]``; the paper's 3e-4 / 4e-4.
        kl_beta (`float`): weight of the k3 KL to the reference (token mean per sequence; the paper uses none: 0).
        adv_std (`str`): the std estimator of the advantages, ``"unbiased"`` (n - 1, TRL's) or ``"population"``.
    """

    clip: ClipOptions = embedded(ClipOptions, clip_low=3e-4, clip_high=4e-4)
    kl: KLOptions = embedded(KLOptions, kl_beta=0.0)
    advantage: AdvantageOptions = embedded(AdvantageOptions, scale_rewards="group", adv_std="unbiased", adv_eps=1e-4)
    ground_truth_member: bool = False

    __post_init__ = check_fields  # every check is the fields' own or the shared records'


GSPOConfig.__doc__ += GROUND_TRUTH_DOC


class GSPO:
    """Sequence-level clipped ratio on group-normalised advantages."""

    Config = GSPOConfig
    scoring = "trajectory"
    plan_family = "token"  # the plan type `schedule` returns
    schedule, advantages = _token.schedule, _options.advantages  # the token plan; the shared advantage options

    def __init__(self, config: GSPOConfig):
        self.config = config
        self.kl = KLWeight(config.kl)  # the KL weight, moving under a schedule
        self.traits = token_traits(config, self.kl)

    def loss(self, new: Score, old_log_prob, advantages, ref: Score | None = None) -> LossOutput:
        """Clipped sequence surrogate; arguments as [`~mmgrpo.algorithms.grpo.GRPO.loss`]. Metrics are per
        sequence (``ratio_mean`` is the mean sequence ratio)."""
        clip = self.config.clip
        mask = token_mask(new, new.log_prob)  # [n, T]
        lengths = mask.sum(dim=1)  # [n]
        seq_log_ratio = ((new.log_prob - old_log_prob) * mask).sum(dim=1) / lengths.clamp_min(1.0)  # [n]
        per_sequence, binds = clipped_objective(seq_log_ratio[:, None], advantages, clip.clip_low, clip.high)  # [n, 1]
        has_tokens = (lengths > 0).to(per_sequence.dtype)[:, None]  # [n, 1]
        policy_loss = (per_sequence * has_tokens).sum() / has_tokens.sum().clamp_min(1.0)
        metrics = ratio_metrics(seq_log_ratio[:, None], has_tokens, binds, policy_loss)
        loss = add_kl(policy_loss, metrics, new, ref, mask, self.kl(), "sequence_mean")
        return LossOutput(loss=loss, metrics=metrics)


PLUGIN = GSPO
