"""Parsing the segmentation prompts a VLM writes (boxes, points, labels) and mapping them to the original image (not a
plugin: no ``PLUGIN``; shared by `sam_mask` and `seg_zero`).

Two peer formats:

- ``"seg_zero"`` (Seg-Zero / VisionReasoner, https://arxiv.org/abs/2503.06520): ``<think>...</think><answer>{"bbox":
  [x1, y1, x2, y2], "points_1": [x, y], "points_2": [x, y]}</answer>``. The answer holds one JSON object or a list of
  them (VisionReasoner's ``[{"bbox_2d": [...], "point_2d": [x, y]}, ...]`` is read too: ``bbox`` / ``bbox_2d`` for the
  box, ``points_1``, ``points_2``, ``point_2d`` for its points, all positive).
- ``"seg_r1"`` (Seg-R1, https://arxiv.org/abs/2506.22624): ``<bbox>[x1,y1,x2,y2]</bbox>`` (several boxes: several
  tags, or 4k numbers in one), ``<points>[[x,y],...]</points>`` and ``<labels>[1,0,...]</labels>`` (1 foreground, 0
  background; missing or of another length than the points: every point is foreground, counter ``bad_labels``).
  Each point goes with the first box that contains it (Seg-R1 prompts each box with the points inside it and unites
  the masks); a point inside no box is dropped (counter ``points_unassigned``).

Frames: numbers are read in the frame `coords` of `box_iou` (``resized`` / ``original`` / ``norm1000`` / ``norm1``, or
``model``: the one the pipeline declares in ``metadata["coords"]``) and
mapped to original-image pixels with `BoxIoU.to_original` (a point ``(x, y)`` maps as the box ``[x, y, x, y]``).

Malformed output never raises; it sets counters (each 0/1 per sample) and leaves fewer or no prompts:
``no_answer`` (seg_zero: no ``<answer>`` block or no JSON in it; seg_r1: no ``<bbox>`` tag), ``several_answers``
(seg_zero: more than one ``<answer>`` block: nothing is read, so hedging cannot pay), ``bad_json`` (seg_zero: the
answer is not JSON of the expected shape), ``non_finite`` (a NaN / infinite number: that box or point is dropped),
``inverted`` (``x2 < x1`` or ``y2 < y1``: the box is dropped), ``clipped`` (a box reached outside the image: clipped to
it), ``points_outside`` (a point outside the image: dropped), ``points_unassigned``, ``bad_labels``, ``no_box`` (no
usable box remains: no mask is made). Parsing is linear in the text (tag blocks by `str.find`, numbers by the
non-overlapping regex of `box_iou`, one `json.loads`); texts are length-capped by the caller (`cut_texts`).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field

import torch

from mmgrpo.rewards._common import last_tag_block, tag_spans
from mmgrpo.rewards.box_iou import _NUMBER, BoxIoU

FORMATS = ("seg_zero", "seg_r1")
COUNTERS = ("no_answer", "several_answers", "bad_json", "non_finite", "inverted", "clipped", "points_outside",
            "points_unassigned", "bad_labels", "no_box")
_NUMBERS = re.compile(_NUMBER)
_BOX_KEYS = ("bbox", "bbox_2d")
_POINT_KEYS = ("points_1", "points_2", "point_2d")


@dataclass
class SegPrompt:
    """The prompts of one answer, in original-image pixels.

    Args:
        boxes (`list[list[float]]`): `K` boxes ``[x1, y1, x2, y2]``.
        points (`list[list[list[float]]]`): for each box, its points ``[x, y]`` (maybe none).
        labels (`list[list[int]]`): for each box, one label per point (1 foreground, 0 background).
        counters (`dict[str, float]`): every name of [`COUNTERS`] -> 0 or 1.
    """

    boxes: list[list[float]] = field(default_factory=list)
    points: list[list[list[float]]] = field(default_factory=list)
    labels: list[list[int]] = field(default_factory=list)
    counters: dict[str, float] = field(default_factory=lambda: dict.fromkeys(COUNTERS, 0.0))


def _numbers(text: str, limit: int) -> list[float]:
    """At most `limit` numbers written in `text`, as floats (an overflowing one is infinite)."""
    out = []
    for match in _NUMBERS.finditer(text):
        if len(out) >= limit:
            break
        out.append(float(match.group()))
    return out


def _pairs(values: list[float], size: int) -> list[list[float]]:
    return [values[i : i + size] for i in range(0, len(values) - len(values) % size, size)]


def _json_objects(answer: str) -> list[dict] | None:
    """The objects of a Seg-Zero answer (one JSON object or a list of them between the first ``{`` or ``[`` and the
    last ``}`` or ``]``), or None when it is not such JSON."""
    starts = [i for i in (answer.find("{"), answer.find("[")) if i >= 0]
    end = max(answer.rfind("}"), answer.rfind("]"))
    if not starts or end < min(starts):
        return None
    try:
        value = json.loads(answer[min(starts) : end + 1])
    except (ValueError, RecursionError):
        return None
    value = [value] if isinstance(value, dict) else value
    if not isinstance(value, list) or not value or not all(isinstance(v, dict) for v in value):
        return None
    return value


def _as_numbers(value, size: int) -> list[float] | None:
    """`value` as a list of `size` floats when it is a list of `size` JSON numbers, else None."""
    if not isinstance(value, (list, tuple)) or len(value) != size:
        return None
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
        return None
    try:
        return [float(v) for v in value]
    except OverflowError:  # an integer beyond the float range
        return [math.inf] * size


def parse_seg_zero(text: str, counters: dict, max_boxes: int) -> list[tuple[list[float], list[list[float]], list[int]]]:
    """Boxes with their points and labels from a Seg-Zero answer, model frame; sets `counters`."""
    spans = list(tag_spans(text, "<answer>", "</answer>"))
    if len(spans) > 1:
        counters["several_answers"] = 1.0
        return []
    if not spans:
        counters["no_answer"] = 1.0
        return []
    objects = _json_objects(text[spans[0][0] : spans[0][1]])
    if objects is None:
        counters["bad_json"] = 1.0
        return []
    found = []
    for item in objects[:max_boxes]:
        box = next((_as_numbers(item[k], 4) for k in _BOX_KEYS if k in item), None)
        points = [_as_numbers(item[k], 2) for k in _POINT_KEYS if k in item]
        if box is None or any(p is None for p in points):
            counters["bad_json"] = 1.0
            continue
        found.append((box, points, [1] * len(points)))
    return found


def parse_seg_r1(text: str, counters: dict, max_boxes: int, max_points: int) -> list[tuple[list[float], list, list]]:
    """Boxes with their points and labels from a Seg-R1 answer, model frame; sets `counters`. Points are grouped by
    box later, after the mapping (containment is tested in original pixels)."""
    box_numbers = [n for b, e in tag_spans(text, "<bbox>", "</bbox>") for n in _numbers(text[b:e], 4 * max_boxes)]
    if not any(True for _ in tag_spans(text, "<bbox>", "</bbox>")):
        counters["no_answer"] = 1.0
    boxes = _pairs(box_numbers[: 4 * max_boxes], 4)
    points_text = last_tag_block(text, "points")
    points = _pairs(_numbers(points_text, 2 * max_points), 2) if points_text is not None else []
    labels_text = last_tag_block(text, "labels")
    labels = [int(v) for v in _numbers(labels_text, max_points) if v in (0.0, 1.0)] if labels_text is not None else []
    if len(labels) != len(points):
        counters["bad_labels"] = float(bool(points))
        labels = [1] * len(points)
    return [(box, points, labels) for box in boxes] if boxes else []


def _finite(values) -> bool:
    return all(math.isfinite(v) for v in values)


def _map_points(points, labels, mapper: BoxIoU, metadata: dict, index: int, counters: dict) -> list[tuple]:
    """``([x, y], label)`` in original pixels for each finite point inside the image; sets `counters`."""
    width, height = (float(s) for s in metadata["image_size"])
    kept = []
    for point, label in zip(points, labels):
        if not _finite(point):
            counters["non_finite"] = 1.0
            continue
        x, y = mapper.to_original(torch.tensor([point * 2], dtype=torch.float64), metadata, index)[0, :2].tolist()
        if not (0 <= x <= width and 0 <= y <= height):
            counters["points_outside"] = 1.0
            continue
        kept.append(([x, y], int(label)))
    return kept


def map_prompts(found, mapper: BoxIoU, metadata: dict, index: int, group_by_box: bool) -> SegPrompt:
    """Maps parsed boxes and points to original pixels, drops the malformed ones and clips boxes to the image.

    Args:
        found (`list`): ``(box, points, labels)`` per box (model frame); with `group_by_box` every entry holds all the
            answer's points, and each point goes with the first box containing it.
        mapper ([`BoxIoU`]): its `coords` and ``to_original`` map the frame.
        metadata (`dict`): ``image_size`` (and ``input_size`` for the resized frame).
        index (`int`): the sample, for errors.
        group_by_box (`bool`): Seg-R1's grouping of points by box.
    """
    prompt = SegPrompt()
    counters = prompt.counters
    width, height = (float(s) for s in metadata["image_size"])
    limits = torch.tensor([width, height, width, height], dtype=torch.float64)
    shared = _map_points(found[0][1], found[0][2], mapper, metadata, index, counters) if group_by_box and found else []
    free = list(range(len(shared)))  # Seg-R1: points not yet given to a box
    for box, points, labels in found:
        if not _finite(box):
            counters["non_finite"] = 1.0
            continue
        mapped = mapper.to_original(torch.tensor([box], dtype=torch.float64), metadata, index)[0]  # [4]
        if mapped[2] < mapped[0] or mapped[3] < mapped[1]:
            counters["inverted"] = 1.0
            continue
        clipped = torch.minimum(mapped.clamp_min(0), limits)  # [4]
        counters["clipped"] = max(counters["clipped"], float((clipped != mapped).any()))
        x1, y1, x2, y2 = clipped.tolist()
        if group_by_box:
            mine = [j for j in free if x1 <= shared[j][0][0] <= x2 and y1 <= shared[j][0][1] <= y2]
            free = [j for j in free if j not in mine]
            kept = [shared[j] for j in mine]
        else:
            kept = _map_points(points, labels, mapper, metadata, index, counters)
        prompt.boxes.append([x1, y1, x2, y2])
        prompt.points.append([p for p, _ in kept])
        prompt.labels.append([label for _, label in kept])
    counters["points_unassigned"] = float(bool(free) and bool(prompt.boxes))
    counters["no_box"] = float(not prompt.boxes)
    return prompt


def parse_prompt(text: str | None, answer_format: str, mapper: BoxIoU, metadata: dict, index: int = 0,
                 max_boxes: int = 16, max_points: int = 32) -> SegPrompt:
    """The SAM prompts of one (already length-capped) answer in original-image pixels, see the module docstring;
    never raises on the text (a missing ``image_size`` / ``input_size`` raises `BoxIoU`'s error naming the key)."""
    counters = dict.fromkeys(COUNTERS, 0.0)
    if text is None:
        found = []
        counters["no_answer"] = 1.0
    elif answer_format == "seg_zero":
        found = parse_seg_zero(text, counters, max_boxes)
    else:
        found = parse_seg_r1(text, counters, max_boxes, max_points)
    if "image_size" not in metadata:  # the mapping and the clipping need the image's size
        mapper._size(metadata, "image_size", index)
    prompt = map_prompts(found, mapper, metadata, index, group_by_box=answer_format == "seg_r1")
    prompt.counters = {k: max(counters[k], prompt.counters[k]) for k in COUNTERS}
    return prompt
