"""GDPO (Group Diffusion Policy Optimization): a sequence-level clipped ratio of ELBOs for masked-diffusion LMs.

Paper: Rojas et al., *Improving Reasoning for Diffusion Language Models via Group Diffusion Policy Optimization*,
https://arxiv.org/abs/2510.08554. Instead of diffu-GRPO's one-step token estimate, the likelihood of a completion is
its sequence ELBO, estimated by semi-deterministic Monte Carlo (a fixed Gauss-Legendre rule over the masking ratio,
random masks only; the pipeline's ``likelihood="elbo"`` scoring, options ``pipeline.elbo_points`` /
``elbo_masks`` / ``elbo_masking``, see `pipelines/_mdlm_elbo.py`). With ``E_i`` the ELBO of completion `i` under the
policy, ``E_i^old`` under the sampling policy (recorded at sampling with the same masks) and ``E_i^ref`` under the
reference (adapter disabled), the ratio is one per sequence and the loss is
``mean_i max(-A_i s_i, -A_i clip(s_i, 1 - clip_low, 1 + clip_high)) + kl_beta * mean_i k3_i`` with the k3 KL
``exp(d_i) - d_i - 1``. Two conventions (``elbo_convention``):

- ``"to_first_eos"`` (default; mmgrpo's): the ELBO scores the `|y_i|` tokens up to and including the first EOS (a
  fixed-size mask of ``round(t |y_i|)``, at least 1, weighted ``|y_i| / k``: unbiased), ``s_i = exp((E_i - E_i^old) /
  |y_i|)`` (``length_normalize=False``: ``exp(E_i - E_i^old)``), and the KL is on the length-normalised ELBOs,
  ``d_i = (E_i^ref - E_i) / |y_i|``.
- ``"full_width"`` (GDPO's released code, ``gdpo_trainer.compute_loss`` and ``NumericalIntegrationEstimator`` of
  github.com/KevinRojas1499/GDPO): the ELBO scores every one of the `W` completion positions (``pipeline.gen_length``;
  the EOS fill after the answer included) with ``floor(t W)`` masked positions weighted ``1 / t``,
  ``s_i = exp((E_i - E_i^old) / W)`` with the fixed width `W`, and the KL is on the raw ELBOs,
  ``d_i = E_i^ref - E_i``. Their released recipe also sets ``pipeline.elbo_points: 3``, ``elbo_masks: 1``,
  ``clip_low: 0.5``, ``kl_beta: 0``.

Advantages are ``r - mean`` of the group (no division by the std, as d1 and GDPO's code), or z-scores with
``scale_rewards="group"``. Each likelihood draw is a train unit: ``draws`` estimates with fresh masks per rollout.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from ..losses import clipped_surrogate, k3_kl, masked_mean
from ..types import AlgorithmTraits, LossOutput, Score
from ..plans import MaskedPlan
from ._limits import DRAWS_LIMIT
from . import _options
from ._options import AdvantageOptions, ClipOptions, KLOptions, KLWeight
from ..validation import ConfigError, check_fields, check_range, embedded


@dataclass
class GDPOConfig:
    """Options of [`GDPO`]: its own and the shared clip, KL and advantage options (written flat, see
    ``mmgrpo show gdpo``).

    Args:
        draws (`int`): ELBO estimates per rollout batch, each with its own masks and each a train unit.
        random_masking (`bool`): new mask seeds every step; False reuses one seed.
        clip_low (`float`): the sequence ratio is clipped to ``[1 - clip_low,
            1 + clip_high]`` (0.5, symmetric: d1's value, which GDPO's code base inherits).
        length_normalize (`bool`): divide the ELBO difference by the completion's scored tokens before
            exponentiating (a per-token ratio, as GSPO; the sequence ratio itself is far from 1 on long completions).
            With ``elbo_convention: full_width`` the divisor is the completion width (it must stay true).
        elbo_convention (`str`): ``"to_first_eos"`` (mmgrpo's unbiased estimate of the tokens up to the first EOS,
            ratio per scored token, KL on the length-normalised ELBO) or ``"full_width"`` (GDPO's code: every
            completion position scored, ratio per position of the fixed width, KL on the raw ELBO); see the module
            docstring.
        kl_beta (`float`): weight of the k3 KL to the reference, on the ELBO as `elbo_convention` says (0 skips
            the reference; 0.04 is d1's value and GDPO's config default, 0 their released recipe).
        scale_rewards (`str`): ``"none"`` (default: ``r - mean`` of the group, no std division); ``"group"`` divides
            by the group's std, ``"batch"`` by the batch's.
        adv_std (`str`): that std's estimator with `scale_rewards`: ``"unbiased"`` (n - 1) or ``"population"`` (n).
    """

    draws: int = 1
    random_masking: bool = True
    clip: ClipOptions = embedded(ClipOptions, clip_low=0.5)
    length_normalize: bool = True
    elbo_convention: Literal["to_first_eos", "full_width"] = "to_first_eos"
    kl: KLOptions = embedded(KLOptions, kl_beta=0.0)
    advantage: AdvantageOptions = embedded(AdvantageOptions, scale_rewards="none", adv_std="unbiased")

    def __post_init__(self):
        check_fields(self)
        check_range("draws", self.draws, 1, DRAWS_LIMIT, fix="one ELBO estimate per rollout batch is usual")
        if self.elbo_convention == "full_width" and not self.length_normalize:
            raise ConfigError("length_normalize: false does not go with elbo_convention: full_width (GDPO's code "
                              "divides the log-ratio by the completion width): drop length_normalize, or use "
                              "elbo_convention: to_first_eos.")


class GDPO:
    """GDPO: the ELBO of each completion (semi-deterministic Monte Carlo), a clipped sequence-level ratio."""

    Config = GDPOConfig
    scoring = "likelihood"
    plan_family = "masked"  # the plan type `schedule` returns
    advantages = _options.advantages  # the shared advantage options

    def __init__(self, config: GDPOConfig):
        self.config = config
        self.kl = KLWeight(config.kl)  # the KL weight, moving under a schedule
        self.traits = AlgorithmTraits(reads=frozenset({"log_prob", "mask", "token_mask"}),
                                      needs_reference=self.kl.ever_positive,
                                      zero_advantage_is_inert=not self.kl.ever_positive,
                                      group_local_advantages=config.advantage.group_local)

    def schedule(self, num_steps: int, generator: torch.Generator | None = None) -> MaskedPlan:
        """Every decoding step samples; the units are the ELBO draws ``[[0], [1], ...]``, scored by the ELBO."""
        if self.config.draws > num_steps:
            raise ValueError(f"draws {self.config.draws} must not exceed the {num_steps} decoding steps.")
        seed = int(torch.randint(0, 4096, (1,), generator=generator)) if self.config.random_masking else 42
        return MaskedPlan(num_steps=num_steps, train_units=[[j] for j in range(self.config.draws)],
                          scoring="likelihood", seed=seed, likelihood="elbo",
                          elbo_convention=self.config.elbo_convention)

    def _divisors(self, new: Score) -> tuple:
        """``(ratio divisor, KL divisor)`` of the ELBOs of `new`, each `[n, k]` or a number: the scored tokens
        ``|y_i|`` of ``new.token_mask`` `[n, k, L]` for both (1 without `length_normalize`), or with ``"full_width"``
        the completion width `L` for the ratio and 1 for the KL (the raw ELBOs)."""
        if self.config.elbo_convention == "full_width":
            return new.token_mask.shape[-1], 1
        if not self.config.length_normalize:
            return 1, 1
        lengths = new.token_mask.sum(-1).clamp_min(1).to(new.log_prob.dtype)  # [n, k]
        return lengths, lengths

    def loss(self, new: Score, old_log_prob, advantages, ref: Score | None = None) -> LossOutput:
        """Clipped sequence-level surrogate (+ k3 KL) of one ELBO draw.

        Args:
            new ([`Score`]): the policy's ELBO (``log_prob`` `[n, k]`), its scored tokens (``token_mask``
                `[n, k, L]`) and the draws that are trained (``mask`` `[n, k]`).
            old_log_prob (`torch.FloatTensor` of shape `[n, k]`): the ELBO recorded at sampling, same masks.
            advantages (`torch.FloatTensor` of shape `[n]`).
            ref ([`Score`], *optional*): the reference policy's ELBO (``log_prob``) for the KL term.
        """
        if new.token_mask is None:
            raise ValueError("GDPO needs the scored tokens of each completion (token_mask): use the mdlm pipeline.")
        c = self.config
        ratio_divisor, kl_divisor = self._divisors(new)
        mask = torch.ones_like(old_log_prob, dtype=torch.bool) if new.mask is None else new.mask  # [n, k]
        log_ratio = (new.log_prob - old_log_prob) / ratio_divisor  # [n, k]
        loss, metrics = clipped_surrogate(log_ratio, advantages, c.clip.clip_low, c.clip.high, mask)
        if self.kl() > 0 and ref is not None:
            kl = masked_mean(k3_kl(new.log_prob / kl_divisor, ref.log_prob / kl_divisor), mask)
            loss = loss + self.kl() * kl
            metrics.update(kl=kl.item(), kl_beta=self.kl())
        return LossOutput(loss=loss, metrics=metrics)


PLUGIN = GDPO
