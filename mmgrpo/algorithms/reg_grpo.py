"""Reg-GRPO: the policy's length-normalised log-ratio regressed onto the group-normalised advantage (no clip, no min).

Paper: DeepVideo-R1 (Regressive GRPO), https://arxiv.org/abs/2506.07464. The KL-regularised objective GRPO approximates
has the optimum ``pi*(o|q) = pi_old(o|q) exp(A(q, o) / beta) / Z(q)``, so an advantage is predicted by the policy's
own log-ratio, ``A(q, o) = beta log(pi*(o|q) / pi_old(o|q)) + beta log Z(q)``. Reg-GRPO fits that prediction to the
group-normalised advantage by least squares instead of pushing a clipped surrogate, so no clip or min zeroes the
gradient of a sample that drifted. Here, per sequence ``i`` with tokens ``t`` (mask ``m``)::

    R_i    = reg_beta * (1 / |o_i|) * sum_t m_it * (log pi(o_it) - log pi_old(o_it))     (predicted advantage)
    loss   = mean_i (A_i - P_i)^2  (+ kl_beta * the k3 KL to the reference, per-sequence token mean)

with ``P_i = R_i`` (``center="none"``) or ``P_i = R_i - mean_{j in group(i), in the minibatch} R_j``
(``center="group"``: the group mean removes ``beta log Z(q)``, which all members of a prompt share). The log-ratio is
a per-token mean (as GRPO's per-sequence normalisation; GSPO's sequence ratio) so long answers do not dominate.

Normalising the prediction by its group std as well, as the advantage is, would divide by 0 at the first pass of
every batch (the policy is the old one, every ``R`` is 0), so the prediction is at most centred and its scale is set
by `reg_beta` (the regression drives the mean token log-ratio towards ``A_i / reg_beta``; on-policy
its gradient is ``2 reg_beta`` times GRPO's). ``center="group"`` reads the score's ``group_ids``, which a pipeline
must provide for its ``log_prob``; without centring, the group mean of the prediction is pulled to 0 as well (the
advantages have group mean 0), which anchors the policy's overall log-ratio like a trust region.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from ..types import LossOutput, Score
from ..validation import check_fields, check_range, embedded
from ._limits import SCALE_LIMIT
from . import _options, _token
from ._options import AdvantageOptions, KLOptions, KLWeight
from ._token import GROUND_TRUTH_DOC, TOKEN_READS, add_kl, ratio_metrics, token_mask, token_traits


@dataclass
class RegGRPOConfig:
    """Options of [`RegGRPO`]: its own and the shared KL and advantage options (written flat, see ``mmgrpo show
    reg_grpo``); no clip (the regression has none).

    Args:
        reg_beta (`float`): ``beta`` of the predicted advantage ``beta * mean_t log(pi / pi_old)`` (> 0).
        center (`str`): ``"none"``: the prediction is the scaled log-ratio itself; ``"group"``: minus its mean over
            the group's members in the minibatch (the paper's cancelling of ``log Z(q)``; reads ``group_ids``).
        kl_beta (`float`): weight of the k3 KL to the reference (0 skips the reference forward).
        adv_std (`str`): the std estimator of the advantages, ``"unbiased"`` (n - 1, TRL's) or ``"population"``.
    """

    reg_beta: float = 1.0
    center: Literal["none", "group"] = "none"
    kl: KLOptions = embedded(KLOptions, kl_beta=0.0)
    advantage: AdvantageOptions = embedded(AdvantageOptions, scale_rewards="group", adv_std="unbiased", adv_eps=1e-4)
    ground_truth_member: bool = False

    def __post_init__(self):
        check_fields(self)
        check_range("reg_beta", self.reg_beta, 1e-3, SCALE_LIMIT,
                    fix="1.0 makes the target log-ratio the advantage (the target is advantage / reg_beta)")


RegGRPOConfig.__doc__ += GROUND_TRUTH_DOC


def group_centred(values: torch.Tensor, group_ids: torch.Tensor, present: torch.Tensor) -> torch.Tensor:
    """`values` `[n]` minus the mean over the `present` members of their group in this minibatch.

    Args:
        values (`torch.FloatTensor` of shape `[n]`), group_ids (`torch.LongTensor` of shape `[n]`),
        present (`torch.FloatTensor` of shape `[n]`): 1 for a sample that counts (has scored tokens), else 0.
    """
    _, inverse = torch.unique(group_ids.to(values.device), return_inverse=True)
    groups = int(inverse.max()) + 1
    sums = values.new_zeros(groups).index_add(0, inverse, values * present)  # [groups]
    counts = values.new_zeros(groups).index_add(0, inverse, present)  # [groups]
    return values - (sums / counts.clamp_min(1.0))[inverse]  # [n]


class RegGRPO:
    """Least-squares fit of ``reg_beta`` times the mean token log-ratio to the group-normalised advantage."""

    Config = RegGRPOConfig
    scoring = "trajectory"
    plan_family = "token"  # the plan type `schedule` returns
    schedule, advantages = _token.schedule, _options.advantages  # the token plan; the shared advantage options

    def __init__(self, config: RegGRPOConfig):
        self.config = config
        self.kl = KLWeight(config.kl)  # the KL weight, moving under a schedule
        reads = TOKEN_READS | ({"group_ids"} if config.center == "group" else set())
        self.traits = token_traits(config, self.kl, reads=reads)

    def loss(self, new: Score, old_log_prob, advantages, ref: Score | None = None) -> LossOutput:
        """Squared error between the advantage and the predicted one, mean over the sequences with scored tokens;
        arguments as [`~mmgrpo.algorithms.grpo.GRPO.loss`] (``new.group_ids`` `[n]` with ``center="group"``).
        ``clip_frac`` is 0 (nothing is clipped); ``pred_adv`` is the mean absolute predicted advantage."""
        c = self.config
        mask = token_mask(new, new.log_prob)  # [n, T]
        log_ratio = new.log_prob - old_log_prob  # [n, T]
        lengths = mask.sum(dim=1)  # [n]
        present = (lengths > 0).to(log_ratio.dtype)  # [n]
        predicted = c.reg_beta * (log_ratio * mask).sum(dim=1) / lengths.clamp_min(1.0)  # [n]
        if c.center == "group":
            predicted = group_centred(predicted, new.group_ids, present)
        errors = (advantages.to(predicted.dtype) - predicted) ** 2  # [n]
        policy_loss = (errors * present).sum() / present.sum().clamp_min(1.0)
        metrics = ratio_metrics(log_ratio, mask, torch.zeros_like(mask, dtype=torch.bool), policy_loss)
        metrics["pred_adv"] = float((predicted.detach().abs() * present).sum() / present.sum().clamp_min(1.0))
        loss = add_kl(policy_loss, metrics, new, ref, mask, self.kl(), "sequence_mean")
        return LossOutput(loss=loss, metrics=metrics)


PLUGIN = RegGRPO
