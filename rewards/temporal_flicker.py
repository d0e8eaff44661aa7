"""Temporal flickering of videos, VBench's rule: how little consecutive 8-bit frames differ, pixel by pixel.

VBench: https://arxiv.org/abs/2311.17982 (dimension "temporal flickering"). With the frames quantised to 8 bits,
``q_i = round(255 * clamp(x_i, 0, 1))``, and the `F'` frames kept by `frame_stride` (``0, k, 2k, ...``)::

    D = mean over i = 0 .. F' - 2 of mean over (c, h, w) of |q_i - q_{i+1}|
    score = (255 - D) / 255

so a still video scores 1 and a video whose every pixel jumps between 0 and 255 scores 0. VBench applies it to
videos of static scenes, where any change is flicker; on a video that moves, motion lowers the score too (this reward
does not tell flicker from motion; combine it with a reward for the motion you want). A video with a single kept frame
has no pair to compare and scores NaN (not applicable). Pixels that are NaN or infinite count as 0 (+inf as 1) and the
sample is counted in ``malformed``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from mmgrpo.rewards._common import (
    FRAME_STRIDE_LIMIT, fixed_artifacts, fixed_modalities, frames, nans, non_finite_samples,
)
from mmgrpo.types import PromptBatch, RewardResult
from mmgrpo.validation import check_fields, check_range


@dataclass
class TemporalFlickerConfig:
    """Configuration of [`TemporalFlicker`].

    Args:
        frame_stride (`int`, defaults to 1): compares frames ``0, k, 2k, ...`` (k = the stride) with their next kept
            frame; 1 is VBench's rule.
    """

    frame_stride: int = 1

    def __post_init__(self):
        check_fields(self)
        check_range("temporal_flicker.frame_stride", self.frame_stride, 1, FRAME_STRIDE_LIMIT,
                    fix="1 compares every pair of frames")


def mean_abs_difference(videos: torch.Tensor) -> torch.Tensor:
    """``D`` `[N]`: the mean over consecutive frame pairs and over pixels of ``|q_i - q_{i+1}|`` in 8-bit levels, of
    videos `[N, F, 3, H, W]` in [0, 1] (NaN where F < 2)."""
    if videos.shape[1] < 2:
        return nans(videos.shape[0])
    levels = (videos.clamp(0, 1) * 255).round()  # [N, F, 3, H, W], integers 0..255 as float32
    return (levels[:, 1:] - levels[:, :-1]).abs().flatten(1).mean(dim=1).float()  # [N]; every pair has the same size


class TemporalFlicker:
    """Scores ``outputs["videos"]`` `[N, F, 3, H, W]` in [0, 1] by the stillness of consecutive frames."""

    Config = TemporalFlickerConfig
    modalities = frozenset({"video"})
    group_stage = None  # each score depends on its sample only (see mmgrpo.protocols.RewardFn)
    artifacts = frozenset()  # adds nothing for the sample writers

    modalities_for = classmethod(fixed_modalities)  # see mmgrpo.protocols.RewardFn
    artifacts_for = classmethod(fixed_artifacts)

    def __init__(self, config: TemporalFlickerConfig | None = None):
        self.config = config or TemporalFlickerConfig()

    def __call__(self, outputs: dict[str, Any], batch: PromptBatch) -> RewardResult:
        """Returns `scores` `[N]` (NaN for a single kept frame) and `components` ``mean_abs_diff`` (``D``, in 8-bit
        levels) and ``malformed``, each `[N]`."""
        pixels, per_sample = frames(outputs, "video", "temporal_flicker", self.config.frame_stride)  # [N * F', ...]
        videos = pixels.view(-1, per_sample, *pixels.shape[1:])  # [N, F', 3, H, W]
        difference = mean_abs_difference(videos)  # [N]
        return RewardResult(
            scores=(255.0 - difference) / 255.0,
            components={"mean_abs_diff": difference, "malformed": non_finite_samples(outputs, "video")},
        )


PLUGIN = TemporalFlicker
