"""SAPO: a soft, temperature-controlled gate on the token ratio instead of a hard clip.

Paper: Soft Adaptive Policy Optimization, https://arxiv.org/abs/2511.20347. Each token's objective is
``f(r) A`` with ``f(r) = sigmoid(tau (r - 1)) * 4 / tau``: its gradient ``4 sigmoid (1 - sigmoid)`` is 1 on-policy and
decays smoothly as the ratio leaves 1, instead of dropping to 0 at a clip edge. ``tau`` is ``tau_pos`` for positive
advantages and ``tau_neg`` (slightly larger: negative tokens are damped faster) otherwise. The loss of a minibatch is
``mean_i 1/|o_i| sum_t -f(r_it) A_i`` (per-sequence mean, as TRL's and EasyR1's ``sapo``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..types import LossOutput, Score
from ..validation import check_fields, check_range, embedded
from ._limits import SCALE_LIMIT
from . import _options, _token
from ._options import AdvantageOptions, KLOptions, KLWeight
from ._token import GROUND_TRUTH_DOC, add_kl, aggregate, ratio_metrics, token_mask, token_traits


@dataclass
class SAPOConfig:
    """Options of [`SAPO`]: its gate and the shared KL and advantage options (written flat, see ``mmgrpo show
    sapo``); no clip (the gate replaces it).

    Args:
        tau_pos (`float`), tau_neg (`float`): gate temperatures for positive / non-positive advantages.
        kl_beta (`float`): weight of the k3 KL to the reference (0 skips the reference forward).
        adv_std (`str`): the std estimator of the advantages, ``"unbiased"`` (n - 1, TRL's) or ``"population"``.
    """

    tau_pos: float = 1.0
    tau_neg: float = 1.05
    kl: KLOptions = embedded(KLOptions, kl_beta=0.0)
    advantage: AdvantageOptions = embedded(AdvantageOptions, scale_rewards="group", adv_std="unbiased", adv_eps=1e-4)
    ground_truth_member: bool = False

    def __post_init__(self):
        check_fields(self)
        check_range("tau_pos", self.tau_pos, 1e-3, SCALE_LIMIT, fix="SAPO uses 1.0; the gate's slope is 4 / tau")
        check_range("tau_neg", self.tau_neg, 1e-3, SCALE_LIMIT, fix="SAPO uses 1.05; the gate's slope is 4 / tau")


SAPOConfig.__doc__ += GROUND_TRUTH_DOC


class SAPO:
    """Soft-gated token surrogate on group-normalised advantages."""

    Config = SAPOConfig
    scoring = "trajectory"
    plan_family = "token"  # the plan type `schedule` returns
    schedule, advantages = _token.schedule, _options.advantages  # the token plan; the shared advantage options

    def __init__(self, config: SAPOConfig):
        self.config = config
        self.kl = KLWeight(config.kl)  # the KL weight, moving under a schedule
        self.traits = token_traits(config, self.kl)

    def loss(self, new: Score, old_log_prob, advantages, ref: Score | None = None) -> LossOutput:
        """Soft-gated token surrogate; arguments as [`~mmgrpo.algorithms.grpo.GRPO.loss`]. ``clip_frac`` is the
        fraction of tokens whose gate gradient fell below half its on-policy value."""
        c = self.config
        mask = token_mask(new, new.log_prob)  # [n, T]
        log_ratio = new.log_prob - old_log_prob  # [n, T]
        ratio = torch.exp(log_ratio)
        adv = advantages[:, None].to(ratio.dtype)  # [n, 1]
        tau = torch.where(adv > 0, torch.full_like(adv, c.tau_pos), torch.full_like(adv, c.tau_neg))  # [n, 1]
        gate = torch.sigmoid(tau * (ratio - 1))  # [n, T]
        per_token = -gate * (4 / tau) * adv  # [n, T]
        policy_loss = aggregate(per_token, mask, "sequence_mean")
        damped = 4 * gate * (1 - gate) < 0.5
        metrics = ratio_metrics(log_ratio, mask, damped, policy_loss)
        loss = add_kl(policy_loss, metrics, new, ref, mask, self.kl(), "sequence_mean")
        return LossOutput(loss=loss, metrics=metrics)


PLUGIN = SAPO
