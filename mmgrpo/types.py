"""Typed records passed between the trainer, pipelines, rewards and algorithms.

Shape letters: ``B`` prompts, ``G`` group size, ``N = B * G`` samples, ``S`` decisions (denoising steps or
tokens), ``C/H/W`` channels and pixels.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class PromptBatch:
    """A batch of prompts, with what the reward needs to score the outputs.

    Args:
        prompts (`list[str]`): the text prompts, length `N` after [`~PromptBatch.repeat`].
        metadata (`list[dict]`): one dictionary per prompt (ground truth, task tags...), length `N`.
        group_ids (`torch.LongTensor` of shape `[N]`, *optional*): which group each sample belongs to; samples
            of the same prompt share an id. Ids are global: the same id on two ranks is the same group.
        conditions (`dict`, *optional*): per-item conditioning inputs (images, videos...), each a list of length `N`.
    """

    prompts: list[str]
    metadata: list[dict] = field(default_factory=list)
    group_ids: torch.Tensor | None = None  # [N] long
    conditions: dict[str, list[Any]] = field(default_factory=dict)

    def __post_init__(self):
        if not self.metadata:
            self.metadata = [{} for _ in self.prompts]
        if len(self.metadata) != len(self.prompts):
            raise ValueError(f"PromptBatch has {len(self.prompts)} prompts but {len(self.metadata)} metadata entries.")

    def __len__(self) -> int:
        return len(self.prompts)

    def repeat(self, group_size: int, first_group_id: int = 0) -> "PromptBatch":
        """Repeats each prompt `group_size` times in a row and numbers the groups from `first_group_id`."""
        index = [i for i in range(len(self)) for _ in range(group_size)]
        return PromptBatch(
            prompts=[self.prompts[i] for i in index],
            metadata=[self.metadata[i] for i in index],
            group_ids=torch.tensor(index, dtype=torch.long) + first_group_id,
            conditions={k: [v[i] for i in index] for k, v in self.conditions.items()},
        )

    def select(self, index: list[int] | torch.Tensor) -> "PromptBatch":
        """Returns the sub-batch at `index` (used to split a batch across ranks or minibatches)."""
        index = [int(i) for i in index]
        return PromptBatch(
            prompts=[self.prompts[i] for i in index],
            metadata=[self.metadata[i] for i in index],
            group_ids=None if self.group_ids is None else self.group_ids[index],
            conditions={k: [v[i] for i in index] for k, v in self.conditions.items()},
        )


@dataclass
class Rollout:
    """What a policy sampled, with everything needed to replay and re-score the same transitions.

    Args:
        group_ids (`torch.LongTensor` of shape `[N]`): group of each sample (copied from the prompt batch).
        outputs (`dict`): decoded outputs for rewards, e.g. ``{"images": FloatTensor [N, 3, H, W] in [0, 1]}``.
        old_log_probs (`torch.FloatTensor` of shape `[N, S]`): log-probabilities of the sampled transitions.
        mask (`torch.BoolTensor` of shape `[N, S]`): which transitions are trained (e.g. SDE steps of a window).
        trajectory (`dict`): adapter-private replay state (latents per step, sigmas, prompt embeddings...).
            Algorithms never look inside it; every tensor in it has `N` as first dimension unless its key
            starts with ``shared_``.
    """

    group_ids: torch.Tensor  # [N]
    outputs: dict[str, Any]
    old_log_probs: torch.Tensor  # [N, S]
    mask: torch.Tensor  # [N, S] bool
    trajectory: dict[str, Any] = field(default_factory=dict)

    def __len__(self) -> int:
        return self.old_log_probs.shape[0]

    def select(self, index: torch.Tensor) -> "Rollout":
        """Returns the samples at `index` (a minibatch); ``shared_*`` trajectory entries are kept whole."""

        def pick(value):
            if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == len(self):
                return value[index]
            if isinstance(value, list) and len(value) == len(self):
                return [value[int(i)] for i in index]
            return value

        return Rollout(
            group_ids=self.group_ids[index],
            outputs={k: pick(v) for k, v in self.outputs.items()},
            old_log_probs=self.old_log_probs[index],
            mask=self.mask[index],
            trajectory={k: (v if k.startswith("shared_") else pick(v)) for k, v in self.trajectory.items()},
        )


@dataclass
class RewardResult:
    """Scores of a batch of outputs.

    Args:
        scores (`torch.FloatTensor` of shape `[N]`): the reward; NaN means "not applicable" and is excluded
            from group statistics (never silently 0).
        components (`dict[str, torch.FloatTensor]`): named per-sample parts of the reward, each `[N]`, logged.
    """

    scores: torch.Tensor  # [N] float32
    components: dict[str, torch.Tensor] = field(default_factory=dict)  # name -> [N]


@dataclass
class LossOutput:
    """A scalar loss and the metrics to log with it (clip fraction, approx KL, ratio mean...)."""

    loss: torch.Tensor  # [] scalar with grad
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class SamplingPlan:
    """Which denoising steps (or decisions) are stochastic and which are trained, as an algorithm asks.

    Args:
        num_steps (`int`): number of sampling steps `S`.
        sde_steps (`list[int]`): indices of steps that sample stochastically (the others are deterministic).
        train_units (`list[list[int]]`): the trained steps, grouped into units that are scored and back-propagated
            together (one step each for Flow-GRPO; a chunk of steps for Chunk-GRPO). Every step in a unit must be
            in `sde_steps`.
        noise_level (`float`): the SDE noise scale (eta).
        sde_type (`str`): ``"sde"`` (Flow-GRPO) or ``"cps"`` (coefficients-preserving sampling).
    """

    num_steps: int
    sde_steps: list[int]
    train_units: list[list[int]]
    noise_level: float = 0.7
    sde_type: str = "sde"

    def __post_init__(self):
        bad = [s for unit in self.train_units for s in unit if s not in self.sde_steps]
        if bad:
            raise ValueError(f"SamplingPlan trains steps {bad} that are not stochastic (sde_steps={self.sde_steps}).")

    @classmethod
    def deterministic(cls, num_steps: int) -> "SamplingPlan":
        """An ODE plan (no stochastic step, nothing trained), used for evaluation."""
        return cls(num_steps=num_steps, sde_steps=[], train_units=[], noise_level=0.0)
