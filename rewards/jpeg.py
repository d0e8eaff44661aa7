"""JPEG compressibility (or incompressibility) of images, DDPO's classic programmatic reward.

DDPO: https://arxiv.org/abs/2305.13301 . The score is minus (compressibility) or plus (incompressibility) the JPEG file
size in kilobytes (1000 bytes) at the configured quality, as in DDPO's ``jpeg_compressibility``. Images are quantised to
8 bits (``round(255 * x)``) first. A video (``modality: video``) is scored frame by frame, every `frame_stride`-th
frame, and reduced by `frame_reduce` (mean, min or first frame). Pixels that are NaN or infinite are encoded as 0 (or 1
for +inf) and the sample is counted in ``malformed``; nothing is NaN (every image has a size).
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch
from PIL import Image

from mmgrpo.rewards._common import (
    check_frame_options, fixed_artifacts, frames, modality_option, non_finite_samples, reduce_frames,
)
from mmgrpo.types import PromptBatch, RewardResult
from mmgrpo.validation import check_fields


@dataclass
class JpegConfig:
    """Configuration of [`JpegReward`].

    Args:
        mode (`str`, defaults to `"compressibility"`): ``"compressibility"`` rewards small files, ``"incompressibility"``
            large ones.
        quality (`int`, defaults to 95): JPEG quality used to encode (1-95).
        modality (`str`, defaults to `"image"`): ``"image"`` (``outputs["images"]`` `[N, 3, H, W]`) or ``"video"``
            (``outputs["videos"]`` `[N, F, 3, H, W]`, scored frame by frame).
        frame_stride (`int`, defaults to 1): with ``modality: video``, scores frames ``0, k, 2k, ...`` (k = the stride).
        frame_reduce (`str`, defaults to `"mean"`): with ``modality: video``, a sample's score from its frames' scores:
            ``"mean"``, ``"min"`` or ``"first"`` (frame 0 only; the other frames are not scored).
    """

    mode: Literal["compressibility", "incompressibility"] = "compressibility"
    quality: int = 95
    modality: Literal["image", "video"] = "image"
    frame_stride: int = 1
    frame_reduce: Literal["mean", "min", "first"] = "mean"

    def __post_init__(self):
        check_fields(self)
        check_frame_options("jpeg", self.modality, self.frame_stride, self.frame_reduce)
        if not 1 <= self.quality <= 95:
            raise ValueError(f"jpeg.quality must be in [1, 95], got {self.quality}.")


def jpeg_kilobytes(images: torch.Tensor, quality: int) -> torch.Tensor:
    """JPEG sizes in kilobytes, `[M]` float32, of images `[M, 3, H, W]` in [0, 1]."""
    pixels = (images.clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()  # [M, H, W, 3]
    sizes = []
    for array in pixels:
        buffer = io.BytesIO()
        Image.fromarray(np.ascontiguousarray(array)).save(buffer, format="JPEG", quality=quality)
        sizes.append(buffer.tell() / 1000.0)
    return torch.tensor(sizes, dtype=torch.float32)


class JpegReward:
    """Scores images `[N, 3, H, W]` (or videos `[N, F, 3, H, W]`) in [0, 1] by their JPEG size."""

    Config = JpegConfig
    modalities = frozenset({"image"})  # the default; an instance holds its configured modality
    group_stage = None  # each score depends on its sample only (see mmgrpo.protocols.RewardFn)
    artifacts = frozenset()  # adds nothing for the sample writers

    modalities_for = classmethod(modality_option)  # see mmgrpo.protocols.RewardFn
    artifacts_for = classmethod(fixed_artifacts)

    def __init__(self, config: JpegConfig | None = None):
        self.config = config or JpegConfig()
        self.modalities = self.modalities_for(self.config)

    def __call__(self, outputs: dict[str, Any], batch: PromptBatch) -> RewardResult:
        """Returns `scores` `[N]` (signed size; a video's frame scores reduced by `frame_reduce`) and `components`
        ``jpeg_kb`` (the size that score stands for, ``sign * score``) and ``malformed``, each `[N]`."""
        cfg = self.config
        pixels, per_sample = frames(outputs, cfg.modality, "jpeg", cfg.frame_stride, cfg.frame_reduce)  # [N * F', ...]
        sign = -1.0 if cfg.mode == "compressibility" else 1.0
        scores = reduce_frames(sign * jpeg_kilobytes(pixels, cfg.quality), per_sample, cfg.frame_reduce)  # [N]
        malformed = non_finite_samples(outputs, cfg.modality)
        return RewardResult(scores=scores, components={"jpeg_kb": sign * scores, "malformed": malformed})


PLUGIN = JpegReward
