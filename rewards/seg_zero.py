"""Seg-Zero's rule reward for a VLM that prompts a segmenter: five 0/1 terms (layout, JSON, box IoU, box L1, points).

Seg-Zero: https://arxiv.org/abs/2503.06520 . The score is the sum of the terms, each reported as a component:

1. ``think_format``: the text has the R1 layout ``<think>...</think><answer>...</answer>`` (`format`'s linear check);
2. ``answer_format``: the answer is JSON with a box and two points (``bbox``, ``points_1``, ``points_2``; parsed by
   `mmgrpo.rewards._seg_parse`, one ``<answer>`` block only);
3. ``box_iou``: IoU(predicted box, true box) > `iou_threshold` (0.5);
4. ``box_l1``: the mean absolute difference of the four coordinates (original pixels) < `l1_threshold` (10 px);
5. ``points``: both points lie inside the true box and, when the metadata has true ``points`` (``[[x, y], ...]``,
   original pixels, e.g. the centres of the object's two largest inscribed circles), the mean distance of the best
   one-to-one pairing of predicted and true points is < `point_threshold` (100 px).

``score = sum_k w_k * term_k`` with `weights` (all 1 by default, Seg-Zero's sum; maximum 5). Coordinates are read in
the frame `coords` and mapped to the original image as in `box_iou`. The first predicted object is compared with the
first true box (``metadata[gt_key]``: ``[x1, y1, x2, y2]`` or a list of boxes; ``image_size`` is needed, as for the
mapping); a sample without a true box is not applicable (NaN). An answer without a usable box scores 0 on terms 2-5.
Texts are cut to `max_completion_chars` (``truncated``).
Not checked: the mask (add `sam_mask` in a `composite`), or whether the reasoning is sound.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from mmgrpo.rewards._common import (
    MAX_COMPLETION_CHARS, PIXEL_DISTANCE_LIMIT, WEIGHT_LIMIT, check_max_completion_chars, cut_texts,
    fixed_artifacts, fixed_modalities, nans, texts,
)
from mmgrpo.rewards._matching import max_weight_matching
from mmgrpo.rewards._seg_parse import map_prompts, parse_seg_zero
from mmgrpo.rewards.box_iou import BoxIoU, box_iou
from mmgrpo.rewards.format import r1_layout
from mmgrpo.types import PromptBatch, RewardResult
from mmgrpo.validation import ConfigError, check_fields, check_range, check_text

TERMS = ("think_format", "answer_format", "box_iou", "box_l1", "points")


@dataclass
class SegZeroConfig:
    """Configuration of [`SegZero`].

    Args:
        coords (`str`, defaults to `"model"`): the frame of the model's numbers, as in `box_iou` (``"model"``: the
            frame the pipeline declares in ``metadata["coords"]``; or a fixed frame).
        iou_threshold (`float`, defaults to 0.5): term 3's box IoU threshold.
        l1_threshold (`float`, defaults to 10.0): term 4's mean box L1 threshold, in pixels of the original image.
        point_threshold (`float`, defaults to 100.0): term 5's point distance threshold, in pixels of the original
            image.
        weights (`dict[str, float]`): term name -> weight (defaults to 1 each).
        gt_key (`str`, defaults to `"boxes"`): metadata key of the true box.
        max_completion_chars (`int`, *optional*, defaults to 16384): the text length cap.
    """

    coords: Literal["resized", "original", "norm1000", "norm1", "model"] = "model"
    iou_threshold: float = 0.5
    l1_threshold: float = 10.0
    point_threshold: float = 100.0
    weights: dict[str, float] = field(default_factory=lambda: dict.fromkeys(TERMS, 1.0))
    gt_key: str = "boxes"
    max_completion_chars: int | None = MAX_COMPLETION_CHARS

    def __post_init__(self):
        check_fields(self)
        check_range("iou_threshold", self.iou_threshold, 0, 1, fix="0.5 as Seg-Zero")
        check_range("l1_threshold", self.l1_threshold, 0, PIXEL_DISTANCE_LIMIT, low_open=True,
                    fix="10 pixels as Seg-Zero")
        check_range("point_threshold", self.point_threshold, 0, PIXEL_DISTANCE_LIMIT, low_open=True,
                    fix="100 pixels as Seg-Zero")
        unknown = set(self.weights) - set(TERMS)
        if unknown:
            raise ConfigError(f"weights: unknown terms {sorted(unknown)}; the terms are {list(TERMS)}.")
        for name, weight in self.weights.items():
            if not math.isfinite(float(weight)):
                raise ConfigError(f"weights.{name} must be a finite number, got {weight!r}.")
            check_range(f"weights.{name}", float(weight), -WEIGHT_LIMIT, WEIGHT_LIMIT, fix="1.0 as Seg-Zero")
        self.weights = {**dict.fromkeys(TERMS, 1.0), **{k: float(v) for k, v in self.weights.items()}}
        check_text("gt_key", self.gt_key)
        check_max_completion_chars(self.max_completion_chars)


def point_terms(points: list, box: torch.Tensor, truth_points: Any, threshold: float) -> float:
    """Term 5: both points inside `box` `[4]` and, given true points, their best pairing's mean distance below
    `threshold`."""
    if len(points) != 2:
        return 0.0
    inside = all(box[0] <= x <= box[2] and box[1] <= y <= box[3] for x, y in points)
    if not inside or truth_points is None:
        return float(inside)
    pred = torch.tensor(points, dtype=torch.float64)  # [2, 2]
    true = torch.tensor(truth_points, dtype=torch.float64).reshape(-1, 2)  # [T, 2]
    distance = torch.cdist(pred, true)  # [2, T]
    pairs = max_weight_matching(-distance)
    return float(bool(pairs) and sum(float(distance[i, j]) for i, j in pairs) / len(pairs) < threshold)


class SegZero:
    """Scores ``outputs["texts"]`` with Seg-Zero's format, box and point terms."""

    Config = SegZeroConfig
    modalities = frozenset({"text"})
    group_stage = None  # each score depends on its sample only (see mmgrpo.protocols.RewardFn)
    artifacts = frozenset()  # adds nothing for the sample writers

    modalities_for = classmethod(fixed_modalities)  # see mmgrpo.protocols.RewardFn
    artifacts_for = classmethod(fixed_artifacts)

    def __init__(self, config: SegZeroConfig | None = None):
        self.config = config or SegZeroConfig()
        self.mapper = BoxIoU(BoxIoU.Config(coords=self.config.coords))

    def terms(self, text: str | None, metadata: dict, index: int) -> dict[str, float]:
        """The five 0/1 terms of one answer."""
        c = self.config
        truth = torch.tensor(metadata[c.gt_key], dtype=torch.float64).reshape(-1, 4)[0]  # [4]
        values = dict.fromkeys(TERMS, 0.0)
        self.mapper._size(metadata, "image_size", index)  # the mapping and clipping need it: a clear error otherwise
        if text is None:
            return values
        values["think_format"] = float(r1_layout(text))
        counters: dict[str, float] = {}
        found = parse_seg_zero(text, counters, max_boxes=1)
        values["answer_format"] = float(bool(found) and len(found[0][1]) == 2 and not counters)
        prompt = map_prompts(found, self.mapper, metadata, index, group_by_box=False) if found else None
        if prompt is None or not prompt.boxes:
            return values
        box = torch.tensor(prompt.boxes[0], dtype=torch.float64)  # [4]
        values["box_iou"] = float(box_iou(box[None], truth[None])[0, 0] > c.iou_threshold)
        values["box_l1"] = float((box - truth).abs().mean() < c.l1_threshold)
        values["points"] = point_terms(prompt.points[0], truth, metadata.get("points"), c.point_threshold)
        return values

    def __call__(self, outputs: dict[str, Any], batch: PromptBatch) -> RewardResult:
        """Returns `scores` `[N]` (the weighted sum) and each term and ``truncated`` as components `[N]`."""
        n = len(batch)
        answers, truncated = cut_texts(texts(outputs, n, "seg_zero"), self.config.max_completion_chars)
        columns = {name: nans(n) for name in ("score", *TERMS)}
        for i, (text, metadata) in enumerate(zip(answers, batch.metadata)):
            if self.config.gt_key not in metadata:
                continue
            values = self.terms(text, metadata, i)
            for name, value in values.items():
                columns[name][i] = value
            columns["score"][i] = sum(self.config.weights[k] * values[k] for k in TERMS)
        scores = columns.pop("score")
        return RewardResult(scores=scores, components={**columns, "truncated": truncated})


PLUGIN = SegZero
