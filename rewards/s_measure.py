"""S-measure: the structure similarity of predicted masks to the truth (object and region terms, Fan et al. 2017).

Paper: https://arxiv.org/abs/1708.00786 (ICCV 2017); Seg-R1 (https://arxiv.org/abs/2506.22624) rewards ``0.7 IoU + 0.3
S``.

For a prediction ``P`` in [0, 1] and a binary truth ``T`` (`[H, W]`), with ``mu = mean(T)`` the foreground share:

- ``mu = 0`` (no object): ``S = 1 - mean(P)``; ``mu = 1``: ``S = mean(P)``.
- Otherwise ``S = max(0, alpha * S_object + (1 - alpha) * S_region)`` with ``alpha = 0.5``:
  - **object term** ``S_object = mu * O(P, on T) + (1 - mu) * O(1 - P, on not T)``, where for the values ``x`` of a map
    on a region ``O = 2 * mean(x) / (mean(x)^2 + 1 + std(x) + eps)`` (std with ``n - 1``, 0 for one value): high when
    the prediction is uniformly high on the object and uniformly low on the background;
  - **region term** ``S_region = sum_k w_k * ssim(P_k, T_k)``: the image is cut into four blocks at the truth's
    centroid ``(round(mean row) + 1, round(mean column) + 1)`` (the first block holds rows and columns before it),
    ``w_k`` the share of the image's pixels in block ``k``, and ``ssim(x, y) = 4 mean(x) mean(y) cov(x, y) / ((mean(x)^2
    + mean(y)^2) (var(x) + var(y)) + eps)`` (variances and covariance over ``n - 1``; 1 when numerator and denominator
    are both 0, 0 when only the numerator is).

``eps`` is 1e-8. The computation is `mmgrpo.rewards.mask_iou.s_measure` (shared with `mask_iou`'s ``s_measure_weight``).
Masks are ``outputs["masks"]`` (`[N, H, W]` or `N` tensors, probabilities or bool; None for no mask, scoring 0 with
``malformed`` = 1), resized to the truth with nearest-neighbour interpolation; the truth is ``metadata[gt_key]`` (a
tensor or any encoding of `mmgrpo.rewards._seg_masks.load_mask`); a sample without it is not applicable (NaN). With a
text policy prompting SAM, use `sam_mask`'s ``s_measure_weight`` (its masks exist inside that reward).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from mmgrpo.rewards._common import fixed_artifacts, fixed_modalities, nans
from mmgrpo.rewards._seg_masks import load_mask, predicted_mask
from mmgrpo.rewards.mask_iou import s_measure
from mmgrpo.types import PromptBatch, RewardResult
from mmgrpo.validation import check_fields, check_range, check_text


@dataclass
class SMeasureConfig:
    """Configuration of [`SMeasure`].

    Args:
        alpha (`float`, defaults to 0.5): weight of the object term (Fan et al.: 0.5).
        gt_key (`str`, defaults to `"mask"`): metadata key of the ground-truth mask.
    """

    alpha: float = 0.5
    gt_key: str = "mask"

    def __post_init__(self):
        check_fields(self)
        check_range("alpha", self.alpha, 0, 1, fix="0.5 as Fan et al.")
        check_text("gt_key", self.gt_key)


class SMeasure:
    """Scores ``outputs["masks"]`` by their structure similarity to the ground-truth masks."""

    Config = SMeasureConfig
    modalities = frozenset({"mask"})
    group_stage = None  # each score depends on its sample only (see mmgrpo.protocols.RewardFn)
    artifacts = frozenset()  # adds nothing for the sample writers

    modalities_for = classmethod(fixed_modalities)  # see mmgrpo.protocols.RewardFn
    artifacts_for = classmethod(fixed_artifacts)

    def __init__(self, config: SMeasureConfig | None = None):
        self.config = config or SMeasureConfig()

    def __call__(self, outputs: dict[str, Any], batch: PromptBatch) -> RewardResult:
        """Returns `scores` `[N]` (the S-measure) and `components` ``malformed`` `[N]`."""
        n = len(batch)
        masks = outputs.get("masks")
        if masks is None or len(masks) != n:
            raise ValueError(f"s_measure: expected outputs['masks'] with {n} masks ([N, H, W] or a list), got "
                             f"{type(masks).__name__}.")
        scores, malformed = nans(n), nans(n)
        for i, metadata in enumerate(batch.metadata):
            if self.config.gt_key not in metadata:
                continue
            truth = load_mask(metadata[self.config.gt_key]).cpu()  # [H, W]
            pred = predicted_mask(masks[i], tuple(truth.shape))  # [H, W] in [0, 1], or None
            malformed[i] = float(pred is None)
            scores[i] = 0.0 if pred is None else s_measure(pred, truth, self.config.alpha)
        return RewardResult(scores=scores, components={"malformed": malformed})


PLUGIN = SMeasure
