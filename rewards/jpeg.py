"""JPEG compressibility (or incompressibility) of images, DDPO's classic programmatic reward.

DDPO: https://arxiv.org/abs/2305.13301 . The score is minus (or plus) the JPEG file size in kilobytes.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
from PIL import Image

from mmgrpo.types import PromptBatch, RewardResult


@dataclass
class JpegConfig:
    """Options of [`JpegReward`].

    Args:
        mode (`str`): ``"compressibility"`` rewards small files, ``"incompressibility"`` large ones.
        quality (`int`): JPEG quality used to encode (1-95).
    """

    mode: Literal["compressibility", "incompressibility"] = "compressibility"
    quality: int = 95

    def __post_init__(self):
        if not 1 <= self.quality <= 95:
            raise ValueError(f"quality must be in [1, 95], got {self.quality}.")


class JpegReward:
    """Scores images `[N, 3, H, W]` in [0, 1] by their JPEG size."""

    Config = JpegConfig
    modalities = frozenset({"image"})

    def __init__(self, config: JpegConfig):
        self.config = config

    def __call__(self, outputs: dict, batch: PromptBatch) -> RewardResult:
        images = outputs["images"]  # [N, 3, H, W]
        pixels = (images.clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()
        sizes = []
        for array in pixels:
            buffer = io.BytesIO()
            Image.fromarray(np.ascontiguousarray(array)).save(buffer, format="JPEG", quality=self.config.quality)
            sizes.append(buffer.tell() / 1000.0)
        size_kb = torch.tensor(sizes, dtype=torch.float32)  # [N]
        sign = -1.0 if self.config.mode == "compressibility" else 1.0
        return RewardResult(scores=sign * size_kb, components={"jpeg_kb": size_kb})


PLUGIN = JpegReward
