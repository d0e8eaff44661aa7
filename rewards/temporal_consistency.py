"""Temporal consistency of videos, VBench's subject-consistency rule on open_clip image features.

VBench: https://arxiv.org/abs/2311.17982 (dimensions "subject consistency", on DINO features, and "background
consistency", on CLIP features; the rule is the same). With ``f_i`` the L2-normalised image embedding of kept frame
``i`` (frames ``0, k, 2k, ...`` for `frame_stride` k, ``F'`` of them)::

    score = 1 / (F' - 1) * sum over i = 1 .. F' - 1 of [max(0, cos(f_{i-1}, f_i)) + max(0, cos(f_0, f_i))] / 2

so a video whose frames all embed alike scores 1. It checks that the look of the video stays the same; it does not
check that anything moves (a still video scores 1: combine it with a reward for the motion you want) nor that the
video matches its prompt. A video with a single kept frame has no pair to compare and scores NaN (not applicable).
Frames go through open_clip's eval transform as in `clip_score`; pixels that are NaN or infinite count as 0 (+inf
as 1) and the sample is counted in ``malformed``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from mmgrpo.rewards import _clip
from mmgrpo.rewards._common import (
    FRAME_STRIDE_LIMIT, fixed_artifacts, fixed_modalities, frames, nans, non_finite_samples,
)
from mmgrpo.types import PromptBatch, RewardResult
from mmgrpo.validation import check_fields, check_range


@dataclass
class TemporalConsistencyConfig:
    """Configuration of [`TemporalConsistency`].

    Args:
        model_name (`str`, defaults to `"ViT-L-14"`): the open_clip image encoder, as in `clip_score` (a built-in
            name, ``"local-dir:<folder>"`` or ``"hf-hub:org/repo"``).
        pretrained (`str`, *optional*, defaults to `"openai"`): its open_clip tag or a local checkpoint file; None
            builds random weights (tests only).
        frame_stride (`int`, defaults to 1): compares frames ``0, k, 2k, ...`` (k = the stride); 1 is VBench's rule.
        batch_size (`int`, defaults to 32): frames per CLIP forward.
        device (`str`, defaults to `"auto"`): where the CLIP model runs (``"auto"``: CUDA when available).
    """

    model_name: str = "ViT-L-14"
    pretrained: str | None = "openai"
    frame_stride: int = 1
    batch_size: int = 32
    device: str = "auto"

    def __post_init__(self):
        check_fields(self)
        check_range("temporal_consistency.frame_stride", self.frame_stride, 1, FRAME_STRIDE_LIMIT,
                    fix="1 compares every frame")
        _clip.check_options("temporal_consistency", self)


def consistency_terms(features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The two halves of VBench's rule for L2-normalised frame features `[N, F, D]`: the means over ``i >= 1`` of
    ``max(0, cos(f_{i-1}, f_i))`` and of ``max(0, cos(f_0, f_i))``, each `[N]` (NaN where F < 2)."""
    if features.shape[1] < 2:
        return nans(features.shape[0]), nans(features.shape[0])
    previous = (features[:, :-1] * features[:, 1:]).sum(dim=-1).clamp_min(0)  # [N, F - 1]
    first = (features[:, :1] * features[:, 1:]).sum(dim=-1).clamp_min(0)  # [N, F - 1]
    return previous.mean(dim=1).float(), first.mean(dim=1).float()


class TemporalConsistency:
    """Scores ``outputs["videos"]`` `[N, F, 3, H, W]` in [0, 1] by how alike its frames embed."""

    Config = TemporalConsistencyConfig
    modalities = frozenset({"video"})
    group_stage = None  # each score depends on its sample only (see mmgrpo.protocols.RewardFn)
    artifacts = frozenset()  # adds nothing for the sample writers

    modalities_for = classmethod(fixed_modalities)  # see mmgrpo.protocols.RewardFn
    artifacts_for = classmethod(fixed_artifacts)

    def __init__(self, config: TemporalConsistencyConfig | None = None):
        self.config = config or TemporalConsistencyConfig()
        self.model, _ = _clip.load_open_clip(
            "temporal_consistency", self.config.model_name, self.config.pretrained, self.config.device
        )

    def __call__(self, outputs: dict[str, Any], batch: PromptBatch) -> RewardResult:
        """Returns `scores` `[N]` (NaN for a single kept frame) and `components` ``previous`` and ``first`` (the two
        halves of the rule, the score being their mean) and ``malformed``, each `[N]`."""
        cfg = self.config
        pixels, per_sample = frames(outputs, "video", "temporal_consistency", cfg.frame_stride)  # [N * F', 3, H, W]
        features = _clip.image_embeddings(pixels, self.model, cfg.batch_size)  # [N * F', D], L2-normalised
        previous, first = consistency_terms(features.view(-1, per_sample, features.shape[-1]))  # [N], [N]
        return RewardResult(
            scores=(previous + first) / 2,
            components={"previous": previous, "first": first, "malformed": non_finite_samples(outputs, "video")},
        )


PLUGIN = TemporalConsistency
