"""Mask IoU of predicted binary masks against the truth, optionally mixed with the S-measure, for segmentation policies.

Seg-R1 (https://github.com/geshang777/Seg-R1) rewards ``0.7 * IoU + 0.3 * S-measure``; set ``s_measure_weight=0.3`` for it.
S-measure (structure measure, Fan et al., ICCV 2017, https://arxiv.org/abs/1708.00786) is ``alpha * S_object + (1 -
alpha) * S_region`` with alpha 0.5, computed on the soft prediction, as in the salient-object-detection toolkits.

Predicted masks are ``outputs["masks"]``: a tensor `[N, H, W]` (bool, or probabilities thresholded at `threshold`) or a
list of `N` tensors `[H_i, W_i]` (None for a sample without a mask). The truth is ``metadata[gt_key]`` (default
``"mask"``), `[H, W]` in the original image's pixels (tensor, numpy array or nested lists; non-zero is foreground,
binarised once: a 0/255 mask works). A prediction of another
size (e.g. the processor's resized frame) is resized to the truth's with nearest-neighbour interpolation. Both masks
empty (no target, nothing predicted) scores IoU 1. A missing, non-finite, non-numeric (a string, a list of strings) or
non-2-D prediction scores 0 and sets ``malformed`` = 1; a sample without ground truth is not applicable (NaN).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from mmgrpo.rewards._common import fixed_artifacts, fixed_modalities, nans
from mmgrpo.rewards._seg_masks import predicted_mask
from mmgrpo.types import PromptBatch, RewardResult
from mmgrpo.validation import check_fields, check_range, check_text

_EPS = 1e-8


def _ssim(pred: torch.Tensor, gt: torch.Tensor) -> torch.Tensor:
    """S-measure's structural similarity of one region (`[h, w]` each, float64)."""
    count = pred.numel()
    if count == 0:
        return pred.new_tensor(0.0)
    x, y = pred.mean(), gt.mean()
    denom = max(count - 1, 1)
    var_x, var_y = ((pred - x) ** 2).sum() / denom, ((gt - y) ** 2).sum() / denom
    cov = ((pred - x) * (gt - y)).sum() / denom
    alpha, beta = 4 * x * y * cov, (x**2 + y**2) * (var_x + var_y)
    if alpha != 0:
        return alpha / (beta + _EPS)
    return pred.new_tensor(1.0 if beta == 0 else 0.0)


def _s_object(pred: torch.Tensor, region: torch.Tensor) -> torch.Tensor:
    values = pred[region]
    if values.numel() == 0:
        return pred.new_tensor(0.0)
    mean = values.mean()
    std = values.std() if values.numel() > 1 else values.new_tensor(0.0)
    return 2 * mean / (mean**2 + 1 + std + _EPS)


def s_measure(pred: torch.Tensor, gt: torch.Tensor, alpha: float = 0.5) -> float:
    """Structure measure of a soft prediction `[H, W]` in [0, 1] against a binary truth `[H, W]` (1 = identical)."""
    pred, gt_bool = pred.double(), gt.bool()
    gt = gt_bool.double()
    share = gt.mean()
    if share == 0:
        return float(1 - pred.mean())
    if share == 1:
        return float(pred.mean())
    s_obj = share * _s_object(pred * gt, gt_bool) + (1 - share) * _s_object((1 - pred) * (1 - gt), ~gt_bool)
    h, w = gt.shape
    ys, xs = torch.nonzero(gt_bool, as_tuple=True)
    cy, cx = int(ys.double().mean().round()) + 1, int(xs.double().mean().round()) + 1  # split after the centroid
    s_region = pred.new_tensor(0.0)
    for rows, cols in ((slice(0, cy), slice(0, cx)), (slice(0, cy), slice(cx, w)),
                       (slice(cy, h), slice(0, cx)), (slice(cy, h), slice(cx, w))):
        part = pred[rows, cols]
        s_region = s_region + part.numel() / (h * w) * _ssim(part, gt[rows, cols])
    return max(0.0, float(alpha * s_obj + (1 - alpha) * s_region))


def mask_iou(pred: torch.Tensor, gt: torch.Tensor) -> float:
    """IoU of two boolean masks `[H, W]`; 1 when both are empty."""
    union = (pred | gt).sum()
    return 1.0 if union == 0 else float((pred & gt).sum() / union)


@dataclass
class MaskIoUConfig:
    """Configuration of [`MaskIoU`].

    Args:
        threshold (`float`, defaults to 0.5): a probability mask is foreground where it is above this.
        s_measure_weight (`float`, defaults to 0.0): score ``(1 - w) * IoU + w * S-measure`` (Seg-R1: 0.3).
        gt_key (`str`, defaults to `"mask"`): metadata key of the ground-truth mask.
    """

    threshold: float = 0.5
    s_measure_weight: float = 0.0
    gt_key: str = "mask"

    def __post_init__(self):
        check_fields(self)  # types; floats finite
        check_range("threshold", self.threshold, 0, 1, high_open=True, fix="0.5 for probabilities")
        check_range("s_measure_weight", self.s_measure_weight, 0, 1, fix="0 for IoU only, 0.3 as Seg-R1")
        check_text("gt_key", self.gt_key)


class MaskIoU:
    """Scores ``outputs["masks"]`` against ground-truth masks in ``batch.metadata``."""

    Config = MaskIoUConfig
    modalities = frozenset({"mask"})
    group_stage = None  # each score depends on its sample only (see mmgrpo.protocols.RewardFn)
    artifacts = frozenset()  # adds nothing for the sample writers

    modalities_for = classmethod(fixed_modalities)  # see mmgrpo.protocols.RewardFn
    artifacts_for = classmethod(fixed_artifacts)

    def __init__(self, config: MaskIoUConfig | None = None):
        self.config = config or MaskIoUConfig()

    def __call__(self, outputs: dict[str, Any], batch: PromptBatch) -> RewardResult:
        """Returns `scores` `[N]` and `components` ``iou``, ``s_measure`` and ``malformed``, each `[N]`."""
        n = len(batch)
        masks = outputs.get("masks")
        if masks is None or len(masks) != n:
            raise ValueError(f"mask_iou: expected outputs['masks'] with {n} masks ([N, H, W] or a list), got {type(masks)}.")
        columns = {name: nans(n) for name in ("score", "iou", "s_measure", "malformed")}
        w = self.config.s_measure_weight
        for i, metadata in enumerate(batch.metadata):
            if self.config.gt_key not in metadata:
                continue
            gt = torch.as_tensor(metadata[self.config.gt_key]).detach().cpu().bool()  # [H, W]
            pred = predicted_mask(masks[i], tuple(gt.shape))  # [H, W] in [0, 1], or None
            if pred is None:
                columns["score"][i], columns["iou"][i], columns["s_measure"][i], columns["malformed"][i] = 0, 0, 0, 1
                continue
            iou, structure = mask_iou(pred > self.config.threshold, gt), s_measure(pred, gt)
            columns["iou"][i], columns["s_measure"][i], columns["malformed"][i] = iou, structure, 0
            columns["score"][i] = (1 - w) * iou + w * structure
        scores = columns.pop("score")
        return RewardResult(scores=scores, components=columns)


PLUGIN = MaskIoU
