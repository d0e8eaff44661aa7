"""Image-editing fidelity measured on pixels: what should change changed, and what should stay stayed.

Each prompt's metadata holds its ``source_image`` (the editor's input) and ``target_image`` (the expected result),
optionally an ``edit_mask`` (true where the edit applies); without a mask, the edited region is where target and
source differ (any channel by more than `threshold`). Pixels within `dilation` pixels of the region count for
neither term (edges of a recoloured or removed object are not exact). Everything is measured at the output's
resolution, to which source, target and mask are resized (bilinear; the mask nearest). With ``d(a, b)`` the mean
absolute difference of pixels in [0, 1] over the channels:

    change   = 1 - mean over the region of d(output, target)
    preserve = 1 - mean outside the region grown by `dilation` pixels of d(output, source)
    score    = change_weight * change + (1 - change_weight) * preserve

in [0, 1]; a region that is empty (nothing to change) or the whole image scores its one defined term. The strict
component is 1 when the edit is right on pixels: at least `strict_change_share` of the region's pixels are within
`strict_tolerance` of the target and at least `strict_preserve_share` of the preserved ones within it of the source
(``d`` per pixel; an empty region passes its test), else 0; ``score: strict`` makes it the score. A prompt without source or target image scores NaN (not
applicable). Images are tensors `[3, H, W]` in [0, 1] (or uint8),
PIL images or paths (opened with [`mmgrpo.image_files.open_image`], size-checked); masks are `[H, W]` tensors,
PIL images (non-zero is true) or paths.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from mmgrpo.image_files import MAX_IMAGE_PIXELS_LIMIT, open_image
from mmgrpo.rewards._common import fixed_artifacts, fixed_modalities
from mmgrpo.types import PromptBatch, RewardResult
from mmgrpo.validation import check_fields, check_range


@dataclass
class EditFidelityConfig:
    """Configuration of [`EditFidelityReward`].

    Args:
        change_weight (`float`, defaults to 0.5): weight of the edited region's term; the rest goes to the preserved
            region's.
        threshold (`float`, defaults to 0.1): without an ``edit_mask``, a pixel is edited when target and source differ
            by more than this in some channel (pixels in [0, 1]).
        dilation (`int`, defaults to 1): pixels around the edited region (at the output's resolution) left out of the
            preserved region.
        strict_tolerance (`float`, defaults to 0.25): the strict rule's largest mean absolute difference (over the
            channels, pixels in [0, 1]) of a right pixel.
        strict_change_share (`float`, defaults to 0.8): share of the edited region's pixels that must match the
            target for the strict rule.
        strict_preserve_share (`float`, defaults to 0.98): share of the preserved region's pixels that must match the
            source for the strict rule.
        score (`str`, defaults to ``"graded"``): the score: ``graded`` (the weighted change and preserve terms) or
            ``strict`` (the strict rule's 0 or 1).
    """

    change_weight: float = 0.5
    threshold: float = 0.1
    dilation: int = 1
    strict_tolerance: float = 0.25
    strict_change_share: float = 0.8
    strict_preserve_share: float = 0.98
    score: str = "graded"

    def __post_init__(self):
        check_fields(self)
        check_range("change_weight", self.change_weight, 0.0, 1.0, fix="0.5 weighs both terms alike")
        check_range("threshold", self.threshold, 0.0, 1.0, low_open=True, fix="pixels are in [0, 1]; 0.1 is usual")
        check_range("dilation", self.dilation, 0, 64, fix="0 keeps the region as it is")
        check_range("strict_tolerance", self.strict_tolerance, 0.0, 1.0, low_open=True, fix="0.25 is a quarter of "
                    "the full range")
        check_range("strict_change_share", self.strict_change_share, 0.0, 1.0, fix="a share of pixels")
        check_range("strict_preserve_share", self.strict_preserve_share, 0.0, 1.0, fix="a share of pixels")
        if self.score not in ("graded", "strict"):
            raise ValueError(f"reward.score must be 'graded' or 'strict', got {self.score!r}.")


def as_image(image: Any) -> torch.Tensor:
    """`[3, H, W]` float in [0, 1] of a tensor (float in [0, 1] or uint8), a PIL image or a path."""
    if isinstance(image, torch.Tensor):
        return image.float() / 255 if image.dtype == torch.uint8 else image.float()
    if isinstance(image, (str, Path)):
        with open_image(image, MAX_IMAGE_PIXELS_LIMIT) as opened:
            image = opened.convert("RGB")
    array = np.asarray(image.convert("RGB"), dtype=np.float32) / 255  # [H, W, 3]
    return torch.from_numpy(array).permute(2, 0, 1)


def as_mask(mask: Any) -> torch.Tensor:
    """`[H, W]` bool of a tensor, a PIL image or a path (non-zero is true)."""
    if isinstance(mask, (str, Path)):
        with open_image(mask, MAX_IMAGE_PIXELS_LIMIT) as opened:
            mask = opened.convert("L")
    if not isinstance(mask, torch.Tensor):
        mask = torch.from_numpy(np.asarray(mask.convert("L")))
    return mask.bool()


def _resized(image: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    if tuple(image.shape[-2:]) == size:
        return image
    return F.interpolate(image[None], size=size, mode="bilinear", antialias=True, align_corners=False)[0]


def edit_region(source: torch.Tensor, target: torch.Tensor, mask: torch.Tensor | None, size: tuple[int, int],
                threshold: float, dilation: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The edited region and the preserved one, `[h, w]` bool each at the output's size `size`: `mask` (or where
    target and source differ), and what lies farther than `dilation` pixels from it."""
    if mask is None:
        mask = (target - source).abs().amax(0) > threshold  # [H, W]
    region = F.interpolate(mask[None, None].float(), size=size, mode="nearest")  # [1, 1, h, w]
    grown = F.max_pool2d(region, 2 * dilation + 1, stride=1, padding=dilation) if dilation else region
    return region[0, 0] > 0.5, grown[0, 0] <= 0.5


def fidelity(output: torch.Tensor, source: torch.Tensor, target: torch.Tensor, region: torch.Tensor,
             kept: torch.Tensor, config: EditFidelityConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(change, preserve, strict)`` of one output `[3, h, w]` over the edited `region` and the `kept` one (change and
    preserve NaN where empty; strict 0 or 1)."""
    nan = torch.tensor(float("nan"))
    to_target = (output - target).abs().mean(0)  # [h, w]
    to_source = (output - source).abs().mean(0)  # [h, w]
    change = 1 - to_target[region].mean() if region.any() else nan
    preserve = 1 - to_source[kept].mean() if kept.any() else nan
    tol = config.strict_tolerance
    changed = (to_target[region] <= tol).float().mean() >= config.strict_change_share if region.any() else True
    stayed = (to_source[kept] <= tol).float().mean() >= config.strict_preserve_share if kept.any() else True
    return change, preserve, torch.tensor(float(bool(changed) and bool(stayed)))


class EditFidelityReward:
    """Scores edited images `[N, 3, H, W]` in [0, 1] against each prompt's source and target images."""

    Config = EditFidelityConfig
    modalities = frozenset({"image"})
    group_stage = None  # each score depends on its sample only (see mmgrpo.protocols.RewardFn)
    artifacts = frozenset()

    modalities_for = classmethod(fixed_modalities)  # see mmgrpo.protocols.RewardFn
    artifacts_for = classmethod(fixed_artifacts)

    def __init__(self, config: EditFidelityConfig | None = None):
        self.config = config or EditFidelityConfig()

    def __call__(self, outputs: dict[str, Any], batch: PromptBatch) -> RewardResult:
        """Returns `scores` `[N]` in [0, 1] (graded or strict; NaN without source / target) and components ``edit_change`` and
        ``edit_preserve`` `[N]` (NaN where undefined) and ``strict`` `[N]` (0 or 1, NaN without source / target)."""
        cfg = self.config
        images = outputs["images"].float().clamp(0, 1).cpu()  # [N, 3, H, W]
        size = tuple(images.shape[-2:])
        n = len(images)
        change, preserve = torch.full((n,), float("nan")), torch.full((n,), float("nan"))
        strict = torch.full((n,), float("nan"))
        for i, metadata in enumerate(batch.metadata):
            if metadata.get("source_image") is None or metadata.get("target_image") is None:
                continue
            source, target = as_image(metadata["source_image"]), as_image(metadata["target_image"])
            mask = as_mask(metadata["edit_mask"]) if metadata.get("edit_mask") is not None else None
            aligned = _resized(source, tuple(target.shape[-2:]))  # the source at the target's size
            region, kept = edit_region(aligned, target, mask, size, cfg.threshold, cfg.dilation)
            change[i], preserve[i], strict[i] = fidelity(images[i], _resized(source, size), _resized(target, size),
                                                         region, kept, cfg)
        weighted = cfg.change_weight * change + (1 - cfg.change_weight) * preserve
        scores = torch.where(change.isnan(), preserve, torch.where(preserve.isnan(), change, weighted))
        if cfg.score == "strict":
            scores = strict
        return RewardResult(scores=scores.float(), components={"edit_change": change, "edit_preserve": preserve,
                                                                   "strict": strict})


PLUGIN = EditFidelityReward
