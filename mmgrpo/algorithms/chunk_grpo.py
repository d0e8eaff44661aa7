"""Chunk-GRPO: clipped policy gradient on chunks of consecutive SDE steps (chunk ratio: geometric mean of steps).

The chunk ratio is the geometric mean of its step ratios.

Paper: https://arxiv.org/abs/2510.21583 (code: xingzhejun/GCPO, its "chunk-GRPO" path). Every step is an SDE step;
consecutive steps are grouped into chunks (a fixed list such as ``[2, 3, 4, 7]``, high noise first, or a uniform
`chunk_size`), the chunk log-probability is the mean of its step log-probabilities, and each sample trains a random
`timestep_fraction` of the chunks, optionally drawn with probability proportional to the chunk's relative latent
change. Chunks are the plan's train units, so the trainer replays and back-propagates one chunk at a time.

The loss of an optimizer update is the mean over the (sample, chunk) pairs it trains, as the authors' code (each pair
weighs the same, so a chunk drawn by more samples weighs more: this is what makes the weighted chunk sampling emphasise
the chunks it draws more often); each chunk's loss is its mean over the samples that train it and reports their count
(``traits.update_mean = "entries"`` when a fraction of the chunks is trained). Advantages divide by the group's unbiased
std (n - 1) + 1e-8, as the authors' code (PyTorch's ``std``).

With ``ratio_norm: true`` (default off) each step's log-ratio is GRPO-Guard's normalised one
(https://arxiv.org/abs/2510.22319; see `flow_grpo` and [`~mmgrpo.losses.ratio_norm`]) before the chunk's mean, and a
chunk's objective is divided by the mean ``|dt|`` of its steps (GRPO-Guard's step reweight carried to chunks): our
combination, neither paper's. The k3 term then reads the normalised chunk log-ratio.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from ..losses import clipped_surrogate, k3_kl, masked_mean
from ..plans import FlowPlan
from ..types import AlgorithmTraits, LossOutput, Score
from ..validation import check_fields, check_range, embedded
from ._limits import STEP_LIMIT
from . import _options
from ._options import (
    FASTVIDEO_ADVANTAGES, AdvantageOptions, ClipOptions, KLOptions, KLWeight, RatioOptions, SDEOptions,
)


@dataclass
class ChunkGRPOConfig:
    """Options of [`ChunkGRPO`]: its own and the shared clip, KL and advantage options (written flat, see
    ``mmgrpo show chunk_grpo``) with the authors' defaults.

    Args:
        chunks (`list[int]`, *optional*): chunk lengths from the first (noisiest) step, e.g. ``[2, 3, 4, 7]``; they
            must not sum to more than the sampling steps, and steps after the last chunk are sampled but not trained.
            Default: chunks of `chunk_size` over every step but the last (the last chunk takes the remainder).
        chunk_size (`int`): length of the uniform chunks when `chunks` is not given.
        timestep_fraction (`float`): each sample trains ``max(1, int(num_chunks * timestep_fraction))`` chunks.
        weighting (`str`): how each sample draws its chunks: ``"uniform"``, or ``"latent_change"`` (probability
            proportional to the chunk's mean relative L1 latent change, the authors' weighted chunk sampling).
        clip_low (`float`): the chunk ratio is clipped to ``[1 - clip_low,
            1 + clip_high]`` (GCPO: 5e-5; its ``--right_clip_range`` sets `clip_high`).
        adv_std (`str`), adv_eps (`float`): GCPO's unbiased std (PyTorch's ``std``) + 1e-8.
        adv_clip_max (`float`, *optional*): advantages are clamped to ``[-adv_clip_max, adv_clip_max]`` (5).
        kl_beta (`float`): weight of the k3 estimate ``exp(d) - 1 - d``, ``d = log pi_old - log pi_new`` of the
            chunk, between the sampling and the current policy (0: off, the authors' default).
        ratio_norm (`bool`): GRPO-Guard's RatioNorm of each step and ``1 / mean |dt|`` chunk weight (off).
    """

    chunks: list[int] | None = None
    chunk_size: int = 4
    timestep_fraction: float = 0.5
    weighting: Literal["uniform", "latent_change"] = "uniform"
    clip: ClipOptions = embedded(ClipOptions, clip_low=5e-5)
    advantage: AdvantageOptions = embedded(AdvantageOptions, **FASTVIDEO_ADVANTAGES)
    kl: KLOptions = embedded(KLOptions, kl_beta=0.0)
    sde: SDEOptions = embedded(SDEOptions, noise_level=0.7)
    ratio: RatioOptions = embedded(RatioOptions)

    def __post_init__(self):
        check_fields(self)
        self.ratio.check_sde(self.sde)
        if self.chunks is not None and not self.chunks:
            raise ValueError("chunks must be a non-empty list of chunk lengths (or unset: chunks of chunk_size).")
        for i, length in enumerate(self.chunks or []):
            check_range(f"chunks[{i}]", length, 1, STEP_LIMIT, fix="a chunk is a run of denoising steps")
        check_range("chunk_size", self.chunk_size, 1, STEP_LIMIT, fix="a chunk is a run of denoising steps")
        check_range("timestep_fraction", self.timestep_fraction, 0, 1, low_open=True,
                    fix="each sample trains max(1, int(num_chunks * fraction)) chunks")


class ChunkGRPO:
    """Chunk-GRPO: group-normalised advantages, clipped chunk-level ratio (geometric mean of the step ratios)."""

    Config = ChunkGRPOConfig
    scoring = "trajectory"
    plan_family = "flow"  # the plan type `schedule` returns
    advantages = _options.advantages  # the shared advantage options

    def __init__(self, config: ChunkGRPOConfig):
        self.config = config
        self.kl = KLWeight(config.kl)  # the KL weight (to the sampling policy), moving under a schedule
        self.traits = AlgorithmTraits(
            reads=frozenset({"log_prob", "mask"} | config.ratio.reads),  # mask: the chunks each sample trains
            group_local_advantages=config.advantage.group_local,
            # each trained (sample, chunk) pair weighs the same (with every chunk trained, the same as per sample)
            update_mean="entries" if config.timestep_fraction < 1 else "samples",
        )

    def chunk_units(self, num_steps: int) -> list[list[int]]:
        """The chunks as lists of consecutive step indices."""
        c = self.config
        if c.chunks is None:
            trained = max(1, num_steps - 1)  # the last (noise-free) step is not trained, as the authors
            rest = trained % c.chunk_size
            sizes = [c.chunk_size] * (trained // c.chunk_size) + ([rest] if rest else [])
        else:
            sizes = list(c.chunks)
            if sum(sizes) > num_steps:
                raise ValueError(
                    f"algorithm.chunks {sizes} cover {sum(sizes)} steps but the pipeline samples {num_steps}: make "
                    "them sum to at most pipeline.num_steps."
                )
        starts = [sum(sizes[:k]) for k in range(len(sizes))]
        return [list(range(start, start + size)) for start, size in zip(starts, sizes)]

    def schedule(self, num_steps: int, generator: torch.Generator | None = None) -> FlowPlan:
        """Every step SDE; the chunks are the train units, each sample training a `timestep_fraction` of them."""
        units = self.chunk_units(num_steps)
        per_sample = max(1, int(len(units) * self.config.timestep_fraction))
        return FlowPlan(
            num_steps=num_steps,
            sde_steps=list(range(num_steps)),
            train_units=units,
            noise_level=self.config.sde.noise_level,
            sde_type=self.config.sde.sde_type,
            units_per_sample=per_sample if per_sample < len(units) else 0,
            unit_weighting=self.config.weighting,
            record_mean=self.config.ratio.ratio_norm,
        )

    def loss(self, new: Score, old_log_prob, advantages, ref: Score | None = None) -> LossOutput:
        """Clipped surrogate on one chunk: the mean over the samples that train it, their number as ``entries``.

        Args:
            new ([`Score`]): ``log_prob`` `[n, k]` of the chunk's `k` steps and, optionally, ``mask`` `[n, k]` (samples
                that do not train this chunk are ignored); with `ratio_norm` ``mean``, ``old_mean``, ``std`` and
                ``noise_scale``.
            old_log_prob (`torch.FloatTensor` of shape `[n, k]`): log-probs recorded at sampling.
            advantages (`torch.FloatTensor` of shape `[n]`).
        """
        mask = new.mask
        steps = mask.float() if mask is not None else torch.ones_like(new.log_prob)  # [n, k]
        log_ratio, dt = self.config.ratio.log_ratio(new, old_log_prob)  # [n, k], GRPO-Guard's |dt| [n, k] or None
        count = steps.sum(1).clamp_min(1.0)  # [n]
        chunk_log_ratio = (log_ratio * steps).sum(1) / count  # [n]
        trains = steps.sum(1) > 0  # [n] samples that train this chunk
        # GRPO-Guard's weight, 1 / the mean |dt| of the chunk's steps the sample trains
        weight = None if dt is None else 1 / torch.where(trains, (dt * steps).sum(1) / count, 1.0)[:, None]  # [n, 1]
        clip = self.config.clip
        loss, metrics = clipped_surrogate(chunk_log_ratio[:, None], advantages, clip.clip_low, clip.high,
                                          trains[:, None], weight=weight)
        beta = self.kl()
        if beta > 0:
            # k3 to the old policy: in log-ratio terms the old policy sits at 0
            kl = masked_mean(k3_kl(chunk_log_ratio, torch.zeros_like(chunk_log_ratio)), trains)
            loss = loss + beta * kl
            metrics.update(kl=kl.item(), kl_beta=float(beta))
        return LossOutput(loss=loss, metrics=metrics, entries=float(trains.sum()))

PLUGIN = ChunkGRPO
