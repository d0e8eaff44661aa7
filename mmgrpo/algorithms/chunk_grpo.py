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
std (n - 1), as the authors' code (PyTorch's ``std``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from ..advantages import StdEstimator, group_normalize
from ..losses import clipped_surrogate, k3_kl, masked_mean
from ..types import AlgorithmTraits, LossOutput, Score
from ..plans import FlowPlan
from ._limits import ADV_CLIP_LIMIT, CLIP_LIMIT, KL_BETA_LIMIT, NOISE_LEVEL_RANGE, STEP_LIMIT
from ..validation import check_fields, check_range


@dataclass
class ChunkGRPOConfig:
    """Options of [`ChunkGRPO`].

    Args:
        chunks (`list[int]`, *optional*): chunk lengths from the first (noisiest) step, e.g. ``[2, 3, 4, 7]``; they
            must not sum to more than the sampling steps, and steps after the last chunk are sampled but not trained.
            Default: chunks of `chunk_size` over every step but the last (the last chunk takes the remainder).
        chunk_size (`int`): length of the uniform chunks when `chunks` is not given.
        timestep_fraction (`float`): each sample trains ``max(1, int(num_chunks * timestep_fraction))`` chunks.
        weighting (`str`): how each sample draws its chunks: ``"uniform"``, or ``"latent_change"`` (probability
            proportional to the chunk's mean relative L1 latent change, the authors' weighted chunk sampling).
        clip_low (`float`): lower clip of the chunk ratio, ``1 - clip_low``.
        clip_high (`float`, *optional*): upper clip, ``1 + clip_high`` (unset: `clip_low`, a symmetric clip).
        adv_clip_max (`float`): advantages are clamped to ``[-adv_clip_max, adv_clip_max]``.
        kl_beta (`float`): weight of the k3 estimate ``exp(d) - 1 - d``, ``d = log pi_old - log pi_new`` of the
            chunk, between the sampling and the current policy (0: off, the authors' default).
        noise_level (`float`): SDE noise scale eta.
        sde_type (`str`): ``"sde"`` or ``"cps"``.
        global_std (`bool`): normalise by the batch standard deviation instead of the group's.
        adv_std (`str`): the std estimator of the advantages, ``"unbiased"`` (n - 1, GCPO's) or ``"population"``.
    """

    chunks: list[int] | None = None
    chunk_size: int = 4
    timestep_fraction: float = 0.5
    weighting: Literal["uniform", "latent_change"] = "uniform"
    clip_low: float = 5e-5
    clip_high: float | None = None
    adv_clip_max: float = 5.0
    kl_beta: float = 0.0
    noise_level: float = 0.7
    sde_type: Literal["sde", "cps"] = "sde"
    global_std: bool = False
    adv_std: StdEstimator = "unbiased"

    def __post_init__(self):
        check_fields(self)
        check_range("adv_clip_max", self.adv_clip_max, 0, ADV_CLIP_LIMIT, low_open=True, fix="5 is usual")
        for i, length in enumerate(self.chunks or []):
            check_range(f"chunks[{i}]", length, high=STEP_LIMIT, fix="a chunk is a run of denoising steps")
        check_range("chunk_size", self.chunk_size, high=STEP_LIMIT, fix="a chunk is a run of denoising steps")
        check_range("noise_level", self.noise_level, *NOISE_LEVEL_RANGE, fix="0.7 is usual")
        check_range("kl_beta", self.kl_beta, high=KL_BETA_LIMIT, fix="0 turns the KL term off")
        for key, clip in (("clip_low", self.clip_low), ("clip_high", self.clip_high)):
            if clip is not None:
                check_range(key, clip, high=CLIP_LIMIT, fix="the ratio is clipped to [1 - clip_low, 1 + clip_high]")
        if self.chunks is not None and (not self.chunks or any(c < 1 for c in self.chunks)):
            raise ValueError(f"chunks must be a non-empty list of positive lengths, got {self.chunks}.")
        if self.chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {self.chunk_size}.")
        if not 0 < self.timestep_fraction <= 1:
            raise ValueError(f"timestep_fraction must be in (0, 1], got {self.timestep_fraction}.")
        if self.clip_low <= 0 or (self.clip_high is not None and self.clip_high <= 0):
            raise ValueError(f"clip_low and clip_high must be > 0, got {self.clip_low} and {self.clip_high}.")
        if self.noise_level <= 0:
            raise ValueError(f"noise_level must be > 0 for a stochastic policy, got {self.noise_level}.")
        if self.kl_beta < 0:
            raise ValueError(f"kl_beta must be >= 0, got {self.kl_beta}.")


class ChunkGRPO:
    """Chunk-GRPO: group-normalised advantages, clipped chunk-level ratio (geometric mean of the step ratios)."""

    Config = ChunkGRPOConfig
    scoring = "trajectory"
    plan_family = "flow"  # the plan type `schedule` returns

    def __init__(self, config: ChunkGRPOConfig):
        self.config = config
        self.traits = AlgorithmTraits(
            reads=frozenset({"log_prob", "mask"}),  # mask: the chunks each sample trains
            group_local_advantages=not config.global_std,
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
            noise_level=self.config.noise_level,
            sde_type=self.config.sde_type,
            units_per_sample=per_sample if per_sample < len(units) else 0,
            unit_weighting=self.config.weighting,
        )

    def advantages(self, scores: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
        return group_normalize(scores, group_ids, global_std=self.config.global_std, clip=self.config.adv_clip_max,
                               std=self.config.adv_std)

    def loss(self, new: Score, old_log_prob, advantages, ref: Score | None = None) -> LossOutput:
        """Clipped surrogate on one chunk: the mean over the samples that train it, their number as ``entries``.

        Args:
            new ([`Score`]): ``log_prob`` `[n, k]` of the chunk's `k` steps and, optionally, ``mask`` `[n, k]` (samples
                that do not train this chunk are ignored).
            old_log_prob (`torch.FloatTensor` of shape `[n, k]`): log-probs recorded at sampling.
            advantages (`torch.FloatTensor` of shape `[n]`).
        """
        c = self.config
        mask = new.mask
        steps = mask.float() if mask is not None else torch.ones_like(new.log_prob)  # [n, k]
        chunk_log_ratio = ((new.log_prob - old_log_prob) * steps).sum(1) / steps.sum(1).clamp_min(1.0)  # [n]
        trains = steps.sum(1) > 0  # [n] samples that train this chunk
        high = c.clip_low if c.clip_high is None else c.clip_high
        loss, metrics = clipped_surrogate(chunk_log_ratio[:, None], advantages, c.clip_low, high, trains[:, None])
        if c.kl_beta > 0:
            # k3 to the old policy: in log-ratio terms the old policy sits at 0
            kl = masked_mean(k3_kl(chunk_log_ratio, torch.zeros_like(chunk_log_ratio)), trains)
            loss = loss + c.kl_beta * kl
            metrics["kl"] = kl.item()
        return LossOutput(loss=loss, metrics=metrics, entries=float(trains.sum()))


PLUGIN = ChunkGRPO
