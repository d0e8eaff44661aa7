"""Box IoU of grounding answers: boxes parsed from the model's text, mapped to the original image, matched to the truth.

Continuous IoU for one object as VLM-R1's REC reward, Hungarian matching for several objects as VisionReasoner; a
threshold mode (1 per matched pair with IoU >= threshold) as Seg-Zero. VLM-R1: https://github.com/om-ai-lab/VLM-R1 .

Conventions (one for all models):

- **Boxes** are ``[x1, y1, x2, y2]`` in continuous coordinates; area ``(x2 - x1) * (y2 - y1)`` (no +1 pixel).
- **Frames.** The ground truth is in pixels of the *original* image. The model's numbers are read in the frame set by
  `coords`: ``"resized"`` (pixels of the model input, the processor's resized image: Qwen2.5-VL), ``"original"``
  (pixels of the original image), ``"norm1000"`` (0-1000 relative: Qwen2-VL, Visual-RFT) or ``"norm1"`` (0-1
  relative), and mapped to the original image before the IoU. A frame mismatch is the usual cause of an IoU stuck at 0.
  ``"model"`` (the default) reads the frame the pipeline declares for its model in each sample's
  ``metadata["coords"]`` (the `qwen_vl` pipeline writes ``"resized"`` for Qwen2.5-VL, ``"norm1000"`` for Qwen2-VL,
  Qwen3-VL and Qwen3.5): the convention comes from the model, not from the config; a sample without it is refused,
  naming the fixed frames to set instead.
- **Parsing** (inside the last ``<answer>...</answer>`` when there is one, else the whole text): every ``<box>...</box>``
  or ``<|box_start|>...<|box_end|>`` with 4 numbers (``(x1,y1),(x2,y2)``, ``[x1, y1, x2, y2]`` or ``x1 y1 x2 y2``);
  without such tags, every bracketed list of exactly 4 numbers, which covers JSON (``[{"bbox_2d": [...], "label":
  ...}]``, ``[[...], [...]]``) and a bare ``[x1, y1, x2, y2]``.
- **Score**: the sum of matched IoUs (or hits, in threshold mode) divided by ``max(#predicted, #true)``, so extra and
  missing boxes both cost; 1 for an empty truth (no target) and no predicted box, 0 for an empty truth and any box.

Each text is first cut to `max_completion_chars` characters (component ``truncated`` = 1 where it was); parsing is
linear in the length of the text (tag blocks by `str.find`, numbers by a regex without overlapping quantifiers).

Malformed answers score 0 and set ``malformed`` = 1: no box found when a target exists, or a box that is inverted
(``x2 < x1`` or ``y2 < y1``, kept with IoU 0). Boxes are clipped to the image (``clipped`` = 1 when any was). Samples
without ground truth (no `gt_key` in their metadata) are not applicable: NaN.

Metadata keys (per sample): `gt_key` (default ``"boxes"``): one box or a list of boxes, original-image pixels;
``"image_size"``: ``[width, height]`` of the original image (needed unless ``coords="original"``); ``"input_size"``:
``[width, height]`` of the model input (needed with ``coords="resized"``; e.g. ``image_grid_thw`` w and h times the
patch size for Qwen2.5-VL); ``"coords"``: the frame of the model's numbers (needed with ``coords="model"``, written by
the pipeline).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Literal

import torch

from mmgrpo.rewards._common import (
    MAX_COMPLETION_CHARS, check_max_completion_chars, check_tag, cut_texts, fixed_artifacts, fixed_modalities,
    last_tag_block, nans, tag_spans, texts,
)
from mmgrpo.rewards._matching import max_weight_matching
from mmgrpo.types import PromptBatch, RewardResult
from mmgrpo.validation import check_fields, check_range, check_text

# `\d+(?:\.\d*)?`, not `\d+\.?\d*`: the latter splits a digit run between its two quantifiers in every way before
# failing (quadratic in the run's length)
_NUMBER = r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?"
_TAGS = (("<box>", "</box>"), ("<|box_start|>", "<|box_end|>"))
FRAMES = ("resized", "original", "norm1000", "norm1")  # the frames a model's numbers can be in
_LIST4 = re.compile(rf"[\[(]\s*({_NUMBER})\s*,\s*({_NUMBER})\s*,\s*({_NUMBER})\s*,\s*({_NUMBER})\s*[\])]")


def parse_boxes(text: str, answer_tag: str | None = "answer", max_boxes: int = 100) -> list[list[float]]:
    """The boxes written in `text` (model frame, not mapped), see the module docstring; at most `max_boxes`."""
    if answer_tag:
        text = last_tag_block(text, answer_tag) or text
    tagged = [text[begin:end] for opening, closing in _TAGS for begin, end in tag_spans(text, opening, closing)]
    if tagged:
        found = [[float(x) for x in re.findall(_NUMBER, content)] for content in tagged]
        boxes = [numbers for numbers in found if len(numbers) == 4]
    else:
        boxes = [[float(x) for x in match] for match in _LIST4.findall(text)]
    return [box for box in boxes if all(math.isfinite(x) for x in box)][:max_boxes]


def box_iou(boxes_a: torch.Tensor, boxes_b: torch.Tensor) -> torch.Tensor:
    """Pairwise IoU of ``[x1, y1, x2, y2]`` boxes: `[P, 4]` x `[G, 4]` -> `[P, G]` (``torchvision.ops.box_iou``, in
    float64). Inverted boxes count as empty (area 0, as torchvision would otherwise give them a negative area); a
    pair with zero union has IoU 0 (torchvision's 0 / 0)."""
    from torchvision.ops import box_iou as iou

    def empty_if_inverted(boxes: torch.Tensor) -> torch.Tensor:  # [n, 4] -> [n, 4], x2 >= x1 and y2 >= y1
        boxes = boxes.double()
        return torch.cat([boxes[:, :2], torch.maximum(boxes[:, :2], boxes[:, 2:])], dim=1)

    return torch.nan_to_num(iou(empty_if_inverted(boxes_a), empty_if_inverted(boxes_b)), nan=0.0)  # [P, G]


@dataclass
class BoxIoUConfig:
    """Configuration of [`BoxIoU`] (see the module docstring for frames and parsing).

    Args:
        coords (`str`, defaults to `"model"`): the frame of the model's numbers: ``"model"``, the one the pipeline
            declares for its model in ``metadata["coords"]``, or a fixed ``"resized"``, ``"original"``, ``"norm1000"``
            or ``"norm1"`` (for outputs of a pipeline that declares none).
        threshold (`float`, *optional*): if set, a matched pair counts 1 when its IoU reaches it, else 0.
        answer_tag (`str`, *optional*, defaults to `"answer"`): read boxes inside the last ``<tag>...</tag>``
            when present (None: the whole text).
        gt_key (`str`, defaults to `"boxes"`): metadata key of the ground-truth box(es).
        max_boxes (`int`, defaults to 100): boxes read from one answer at most.
        max_completion_chars (`int`, *optional*, defaults to 16384): each text is cut to this many characters
            before parsing (component ``truncated``); 0 or None: no cut (the parser is linear).
    """

    coords: Literal["resized", "original", "norm1000", "norm1", "model"] = "model"
    threshold: float | None = None
    answer_tag: str | None = "answer"
    gt_key: str = "boxes"
    max_boxes: int = 100
    max_completion_chars: int | None = MAX_COMPLETION_CHARS

    def __post_init__(self):
        check_fields(self)  # types (coords one of the four frames, or "model"); floats finite
        if self.threshold is not None:
            check_range("threshold", self.threshold, 0, 1, low_open=True, fix="or null for the continuous IoU")
        check_range("max_boxes", self.max_boxes, 1, 1024, fix="e.g. 100")
        check_tag("answer_tag", self.answer_tag)
        check_text("gt_key", self.gt_key)
        check_max_completion_chars(self.max_completion_chars)


class BoxIoU:
    """Scores ``outputs["texts"]`` (list of `N` strings) against ground-truth boxes in ``batch.metadata``."""

    Config = BoxIoUConfig
    modalities = frozenset({"text"})
    group_stage = None  # each score depends on its sample only (see mmgrpo.protocols.RewardFn)
    artifacts = frozenset()  # adds nothing for the sample writers

    modalities_for = classmethod(fixed_modalities)  # see mmgrpo.protocols.RewardFn
    artifacts_for = classmethod(fixed_artifacts)

    def __init__(self, config: BoxIoUConfig | None = None):
        self.config = config or BoxIoUConfig()

    def _size(self, metadata: dict, key: str, index: int) -> tuple[float, float]:
        size = metadata.get(key)
        if not (isinstance(size, (list, tuple)) and len(size) == 2 and all(float(s) > 0 for s in size)):
            hint = " (the processor's resized frame)" if key == "input_size" else ""
            raise ValueError(
                f"box_iou: coords={self.frame(metadata, index)!r} needs metadata[{key!r}] = [width, height]{hint} "
                f"for sample {index}, got {size!r}. Add it to the prompt source, or set coords to the frame the model "
                "writes in."
            )
        return float(size[0]), float(size[1])

    def frame(self, metadata: dict, index: int = 0) -> str:
        """The frame of sample `index`'s numbers: the configured one, or with ``coords="model"`` the one the pipeline
        wrote in ``metadata["coords"]``."""
        if self.config.coords != "model":
            return self.config.coords
        coords = metadata.get("coords")
        if coords not in FRAMES:
            raise ValueError(
                f"box_iou: coords='model' reads the frame the pipeline declares for its model in metadata['coords'] "
                f"(one of {list(FRAMES)}), got {coords!r} for sample {index}: this pipeline declares none; set the "
                "reward's coords to the frame the model writes in ('resized', 'original', 'norm1000' or 'norm1')."
            )
        return coords

    def to_original(self, boxes: torch.Tensor, metadata: dict, index: int = 0) -> torch.Tensor:
        """Maps predicted boxes `[P, 4]` from the sample's frame ([`~BoxIoU.frame`]) to original-image pixels."""
        coords = self.frame(metadata, index)
        if coords == "original":
            return boxes
        width, height = self._size(metadata, "image_size", index)
        if coords == "resized":
            in_w, in_h = self._size(metadata, "input_size", index)
            scale = torch.tensor([width / in_w, height / in_h, width / in_w, height / in_h], dtype=boxes.dtype)
        else:
            unit = 1000.0 if coords == "norm1000" else 1.0
            scale = torch.tensor([width, height, width, height], dtype=boxes.dtype) / unit
        return boxes * scale

    def score_one(self, text: str | None, truth: Any, metadata: dict, index: int = 0) -> dict[str, float]:
        """Score and components of one answer against its ground truth (original-image pixels)."""
        try:
            gt = torch.tensor(truth, dtype=torch.float64).reshape(-1, 4)  # [G, 4]
        except (TypeError, ValueError, RuntimeError) as err:
            raise ValueError(
                f"box_iou: metadata[{self.config.gt_key!r}] of sample {index} must be [x1, y1, x2, y2] or a list of "
                f"such boxes (original-image pixels), got {truth!r}."
            ) from err
        boxes = parse_boxes(text, self.config.answer_tag, self.config.max_boxes) if text is not None else []
        result = {"iou": float("nan"), "malformed": 0.0, "clipped": 0.0, "num_boxes": float(len(boxes))}
        if not boxes:
            result["malformed"] = float(len(gt) > 0 or text is None)
            result["score"] = float(len(gt) == 0 and text is not None)
            return result
        if len(gt) == 0:
            result["score"] = 0.0
            return result
        pred = self.to_original(torch.tensor(boxes, dtype=torch.float64), metadata, index)  # [P, 4]
        inverted = (pred[:, 2] < pred[:, 0]) | (pred[:, 3] < pred[:, 1])
        result["malformed"] = float(inverted.any())
        if self.frame(metadata, index) != "original" or "image_size" in metadata:
            width, height = self._size(metadata, "image_size", index)
            limits = torch.tensor([width, height, width, height], dtype=pred.dtype)
            clipped = torch.minimum(pred.clamp_min(0), limits)
            result["clipped"] = float((clipped != pred).any())
            pred = clipped
        iou = box_iou(pred, gt)  # [P, G]
        iou[inverted] = 0.0
        pairs = max_weight_matching(iou)
        matched = torch.tensor([float(iou[i, j]) for i, j in pairs], dtype=torch.float64)
        result["iou"] = float(matched.sum() / max(len(pred), len(gt)))
        if self.config.threshold is not None:
            matched = (matched >= self.config.threshold).double()
        result["score"] = float(matched.sum() / max(len(pred), len(gt)))
        return result

    def __call__(self, outputs: dict[str, Any], batch: PromptBatch) -> RewardResult:
        """Returns `scores` `[N]` and `components` ``iou`` (continuous, NaN without a box pair), ``malformed``,
        ``clipped``, ``num_boxes`` and ``truncated`` (every sample), each `[N]`."""
        n = len(batch)
        answers, truncated = cut_texts(texts(outputs, n, "box_iou"), self.config.max_completion_chars)
        columns = {name: nans(n) for name in ("score", "iou", "malformed", "clipped", "num_boxes")}
        for i, (text, metadata) in enumerate(zip(answers, batch.metadata)):
            if self.config.gt_key not in metadata:
                continue
            for name, value in self.score_one(text, metadata[self.config.gt_key], metadata, i).items():
                columns[name][i] = value
        scores = columns.pop("score")
        return RewardResult(scores=scores, components={**columns, "truncated": truncated})


PLUGIN = BoxIoU
