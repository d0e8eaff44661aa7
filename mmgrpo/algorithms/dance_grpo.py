"""DanceGRPO: clipped per-step policy gradient on a random share of the SDE steps of each sample, every member of a
group starting from one initial noise.

Paper: https://arxiv.org/abs/2505.07818 (code: XueZeyue/DanceGRPO, ``fastvideo/train_grpo_flux.py``). Every step but
the last samples with DanceGRPO's SDE (``sde_type: dance``, see [`~mmgrpo.samplers.flow_sde.dance_step_mean`])::

    x0_hat = x - sigma v,   s_hat = -(x - (1 - sigma) x0_hat) / sigma^2
    x'     = x + dsigma v - eta^2 / 2 * s_hat * dsigma + eta sqrt(-dsigma) * eps,   dsigma = sigma' - sigma < 0

with the exact Gaussian log-probability averaged over the latent's elements. Each sample trains
``int(timestep_fraction * (S - 1))`` of the first ``S - 1`` steps, drawn uniformly without replacement per sample
(the authors: a random permutation per sample, its first steps). With `A` the group-normalised advantage
(``(r - mean) / (std + 1e-8)``, PyTorch's unbiased std) clamped to ``[-5, 5]``, each trained (sample, step) pair adds

    L = max(-A r, -A clip(r, 1 - 1e-4, 1 + 1e-4)),   r = exp(log pi_theta(x' | x) - log pi_old(x' | x))

and an optimizer update averages over its trained pairs (``traits.update_mean = "entries"``: the authors divide each
pair's loss by ``gradient_accumulation_steps * train_timesteps``). No KL term by default (`kl_beta` adds the exact
KL of the Gaussian transitions to the reference, as `flow_grpo`'s ``kl_convention: transition``). With
`init_same_noise` (the authors' FLUX and Wan scripts) the members of a group share one initial noise, so they differ
only by their SDE noise.

Several rewards: the authors' HunyuanVideo script normalises each reward within its group and adds their weighted
clipped losses; MixGRPO's ``advantage_aggr`` adds the weighted per-reward advantages before the clip. The `composite`
reward's ``normalize: advantage_aggr`` gives the latter (equal to the former wherever the ratio lies inside the clip).

Best-of-N (``bestofn``, the authors' HunyuanVideo script's ``--bestofn 8`` of 24 generations): with `A` the
advantages above (with several rewards, their weighted sum: the authors' ``vq_coef * A_vq + mq_coef * A_mq``), only
the ``ceil(bestofn / 2)`` samples of each group with the highest `A` and the ``bestofn // 2`` with the lowest are
trained (their ``sorted[-bestofn//2:]``, ``sorted[:bestofn//2]``), with their `A` of the whole group (not normalised
again); the others get advantage 0 and leave the batch
(``traits.drop_zero_advantage``). A group of exactly ``bestofn`` samples trains all (as their ``num_generations ==
bestofn``).

Differences from the authors' code: the last step is an ODE step instead of an SDE step whose output is replaced by
its ``x0_hat`` for decoding (the same final latent: the Euler step to sigma 0 is ``x0_hat``); the last step is not
trained in either. The shared initial noise is drawn per group from the plan's seed, the same on every process
(theirs: one draw per process, one prompt per process). Sampling and training batch several samples (theirs: one at
a time). Best-of-N selects within each group (theirs: within a process's batch, one group there) and breaks ties by
position (a stable sort); a selected sample whose advantage is exactly 0 leaves the batch too, and a few left-out ones
may come back with advantage 0 to fill equal minibatches ([`~mmgrpo.advantages.kept_samples`]). Not implemented: EMA
of the weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..plans import FlowPlan
from ..types import AlgorithmTraits, LossOutput, Score
from ..validation import check_fields, check_range, embedded
from . import _options
from ._limits import GROUP_LIMIT
from ._flow_common import fastvideo_surrogate, per_step_plan
from ._options import FASTVIDEO_ADVANTAGES, AdvantageOptions, ClipOptions, KLOptions, KLWeight, SDEOptions


@dataclass
class DanceGRPOConfig:
    """Options of [`DanceGRPO`]: its own and the shared clip, KL, advantage and SDE options (written flat, see
    ``mmgrpo show dance_grpo``) with the authors' defaults.

    Args:
        timestep_fraction (`float`): each sample trains ``int(timestep_fraction * (num_steps - 1))`` of the steps
            before the last, drawn per sample (the authors' 0.6).
        init_same_noise (`bool`): the members of a group start from one initial noise (the authors' FLUX and Wan
            scripts); false: each its own.
        noise_level (`float`): eta of the SDE (the authors' 0.3; 0.25 for HunyuanVideo).
        sde_type (`str`): ``"dance"`` (DanceGRPO's SDE); ``"sde"`` / ``"cps"`` sample with Flow-GRPO's steps instead.
        clip_low (`float`): the per-step ratio is clipped to ``[1 - clip_low, 1 + clip_high]`` (1e-4, symmetric).
        adv_std (`str`), adv_eps (`float`): the authors' unbiased std (PyTorch's ``std``) + 1e-8, of the group (or of
            the batch with ``scale_rewards: batch``, the authors' code without ``--use_group``).
        adv_clip_max (`float`, *optional*): advantages are clamped to ``[-adv_clip_max, adv_clip_max]`` (5), in the
            loss as the authors do (so also the advantages a `composite` reward gives as they are).
        kl_beta (`float`): weight of the exact KL of the Gaussian transitions to the reference (0: the authors' code,
            no reference forward).
        bestofn (`int`, *optional*): the authors' best-of-N: of each group only the ``ceil(bestofn / 2)`` samples
            with the highest advantage and the ``bestofn // 2`` with the lowest are trained (their HunyuanVideo
            script: 8 of 24); unset (their FLUX and Wan scripts), or equal to the group size: every sample.
    """

    timestep_fraction: float = 0.6
    init_same_noise: bool = True
    clip: ClipOptions = embedded(ClipOptions, clip_low=1e-4)
    advantage: AdvantageOptions = embedded(AdvantageOptions, **FASTVIDEO_ADVANTAGES)
    kl: KLOptions = embedded(KLOptions, kl_beta=0.0)
    sde: SDEOptions = embedded(SDEOptions, noise_level=0.3, sde_type="dance")
    bestofn: int | None = None

    def __post_init__(self):
        check_fields(self)
        check_range("timestep_fraction", self.timestep_fraction, 0, 1, low_open=True,
                    fix="each sample trains int(fraction * (num_steps - 1)) steps; the authors use 0.6")
        if self.bestofn is not None:
            check_range("bestofn", self.bestofn, 2, GROUP_LIMIT,
                        fix="the samples of a group trained: the best and worst bestofn // 2 (the authors: 8 of 24)")


class DanceGRPO:
    """DanceGRPO: group-normalised advantages, a random share of the steps trained per sample, shared initial noise."""

    Config = DanceGRPOConfig
    scoring = "trajectory"
    plan_family = "flow"  # the plan type `schedule` returns
    advantages = _options.advantages  # the shared advantage options

    def __init__(self, config: DanceGRPOConfig):
        self.config = config
        self.kl = KLWeight(config.kl)  # the KL weight (to the reference), moving under a schedule
        self.traits = AlgorithmTraits(
            reads=frozenset({"log_prob", "mask"}) | self.kl.transition_reads,  # mask: the steps each sample trains
            needs_reference=self.kl.ever_positive,
            group_local_advantages=config.advantage.group_local,
            update_mean="entries",  # every trained (sample, step) pair weighs the same in an update
            selects_samples=True,  # best-of-N (select_samples keeps every sample without bestofn)
            drop_zero_advantage=config.bestofn is not None,  # the samples best-of-N leaves out leave the batch
        )

    def trained_per_sample(self, num_steps: int) -> int:
        """``int(timestep_fraction * (num_steps - 1))``: the steps each sample trains (the last step never)."""
        count = int(self.config.timestep_fraction * (num_steps - 1))
        if count < 1:
            raise ValueError(
                f"algorithm.timestep_fraction {self.config.timestep_fraction} of the {num_steps - 1} steps before the "
                f"last trains no step: raise timestep_fraction or pipeline.num_steps (at least 2)."
            )
        return count

    def schedule(self, num_steps: int, generator: torch.Generator | None = None) -> FlowPlan:
        """SDE on every step but the last (ODE), each of those steps a unit, each sample training its share."""
        c = self.config
        per_sample = self.trained_per_sample(num_steps)
        steps = list(range(num_steps - 1))
        return per_step_plan(num_steps, steps, c.sde, c.init_same_noise, generator,
                             units_per_sample=per_sample if per_sample < len(steps) else 0)

    def select_samples(self, advantages: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
        """The authors' best-of-N: the advantages `[N]` of each group's ``ceil(bestofn / 2)`` highest and
        ``bestofn // 2`` lowest samples (their ``sorted[-bestofn//2:]`` and ``sorted[:bestofn//2]`` of an ascending
        sort, here stable), 0 for the others; all of them without `bestofn` or in a group of exactly `bestofn`."""
        b = self.config.bestofn
        if b is None:
            return advantages
        kept = torch.zeros_like(advantages)  # [N]
        for group in torch.unique(group_ids):
            rows = torch.nonzero(group_ids == group).flatten()
            if len(rows) < b:
                raise ValueError(f"algorithm.bestofn {b} is above the group of {len(rows)} samples: set "
                                 f"train.group_size to at least {b} (the authors: 8 of 24) or lower bestofn.")
            order = torch.argsort(advantages[rows], stable=True)  # ascending
            top = -(-b // 2)  # their sorted[-bestofn//2:]: (-b) // 2 from the end, ceil(b / 2) samples
            chosen = rows if len(rows) == b else rows[torch.cat([order[: b // 2], order[len(order) - top :]])]
            kept[chosen] = advantages[chosen]
        return kept

    def loss(self, new: Score, old_log_prob, advantages, ref: Score | None = None) -> LossOutput:
        """Clipped surrogate on one step, averaged over the samples that train it (their number as ``entries``), plus
        the KL term.

        Args:
            new ([`Score`]): ``log_prob`` `[n, 1]` and ``mask`` `[n, 1]` (the samples that train this step); with a KL
                term ``mean`` `[n, 1, ...]` and ``std`` `[n, 1, 1, ...]`.
            old_log_prob (`torch.FloatTensor` of shape `[n, 1]`): log-probs recorded at sampling.
            advantages (`torch.FloatTensor` of shape `[n]`).
            ref ([`Score`], *optional*): the reference policy's ``mean`` for the KL term.
        """
        c = self.config
        loss, metrics = fastvideo_surrogate(new.log_prob - old_log_prob, advantages, c.advantage, c.clip, new.mask)
        loss = self.kl.add_transition_kl(loss, metrics, new, ref)
        entries = float(new.log_prob.numel() if new.mask is None else new.mask.sum())
        return LossOutput(loss=loss, metrics=metrics, entries=entries)


PLUGIN = DanceGRPO
