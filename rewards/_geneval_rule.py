"""GenEval's object rule on detections (not a plugin): which detections count, and whether they satisfy a prompt's
``include`` / ``exclude`` clauses.

GenEval: https://arxiv.org/abs/2310.11513, ``evaluation/evaluate_images.py`` of https://github.com/djghosh13/geneval.
A prompt's metadata, as in GenEval's ``evaluation_metadata.jsonl`` (and Flow-GRPO's GenEval prompt sets)::

    {"tag": "position", "include": [{"class": "tv", "count": 1},
                                    {"class": "clock", "count": 1, "position": ["below", 0]}]}

The rule, as the authors' ``evaluate``: detections of a class are kept above a confidence threshold (0.9 for
``counting`` prompts, else 0.3), highest first, at most `max_objects` per class, with optional greedy NMS at IoU
`max_overlap` (1: none). An ``include`` clause needs at least ``count`` detections of its class; with ``color``, at
least ``count`` of its ``count`` most confident detections classified as that colour; with ``position: [rel, j]``,
each of them in relation ``rel`` to every object matched by clause ``j`` (``relative_position`` below). An
``exclude`` clause fails when ``count`` or more detections of its class remain. The image is correct when every
clause holds. This module also counts the clauses that hold (the ``partial`` score; GenEval reports only
``correct``). Boxes are ``[x0, y0, x1, y1]`` in pixels.
"""

from __future__ import annotations

import math
from typing import Callable

COLORS = ("red", "orange", "yellow", "green", "blue", "purple", "pink", "brown", "black", "white")
RELATIONS = ("left of", "right of", "above", "below")
# GenEval's `object_names.txt`: the 80 COCO classes as its prompts name them
OBJECT_NAMES = (
    "person", "bicycle", "car", "motorcycle", "airplane", "bus", "train", "truck", "boat", "traffic light",
    "fire hydrant", "stop sign", "parking meter", "bench", "bird", "cat", "dog", "horse", "sheep", "cow", "elephant",
    "bear", "zebra", "giraffe", "backpack", "umbrella", "handbag", "tie", "suitcase", "frisbee", "skis", "snowboard",
    "sports ball", "kite", "baseball bat", "baseball glove", "skateboard", "surfboard", "tennis racket", "bottle",
    "wine glass", "cup", "fork", "knife", "spoon", "bowl", "banana", "apple", "sandwich", "orange", "broccoli",
    "carrot", "hot dog", "pizza", "donut", "cake", "chair", "couch", "potted plant", "bed", "dining table", "toilet",
    "tv", "laptop", "computer mouse", "tv remote", "computer keyboard", "cell phone", "microwave", "oven", "toaster",
    "sink", "refrigerator", "book", "clock", "vase", "scissors", "teddy bear", "hair drier", "toothbrush",
)

Box = tuple[float, float, float, float]
Detections = dict[str, list[tuple[Box, float]]]  # class -> [(box, confidence)], most confident first


def compute_iou(a: Box, b: Box) -> float:
    """IoU of two pixel boxes with GenEval's inclusive ``+ 1`` widths."""
    def area(box):
        return max(box[2] - box[0] + 1, 0) * max(box[3] - box[1] + 1, 0)

    inter = area((max(a[0], b[0]), max(a[1], b[1]), min(a[2], b[2]), min(a[3], b[3])))
    union = area(a) + area(b) - inter
    return inter / union if union else 0.0


def select(found: list[tuple[Box, float]], threshold: float, max_objects: int, max_overlap: float) -> list:
    """The detections of one class GenEval keeps: confidence above `threshold`, most confident first, the first
    `max_objects`, then greedy NMS (drop a detection whose IoU with a kept one is >= `max_overlap`; 1 keeps all)."""
    order = sorted((d for d in found if d[1] > threshold), key=lambda d: -d[1])[:max_objects]
    kept = []
    while order:
        best = order.pop(0)
        kept.append(best)
        order = [d for d in order if max_overlap == 1 or compute_iou(best[0], d[0]) < max_overlap]
    return kept


def relative_position(a: Box, b: Box, threshold: float) -> set[str]:
    """Relations of box `a` to box `b` (GenEval's ``relative_position``): the centre offset, shrunk on each axis by
    `threshold` times the sum of the two boxes' sizes on it, divided by the offset's length; ``"left of"`` where
    its x part is below -0.5, ``"right of"`` above 0.5, ``"above"`` / ``"below"`` likewise in y."""
    offset = ((a[0] + a[2]) / 2 - (b[0] + b[2]) / 2, (a[1] + a[3]) / 2 - (b[1] + b[3]) / 2)
    dims = (abs(a[2] - a[0]) + abs(b[2] - b[0]), abs(a[3] - a[1]) + abs(b[3] - b[1]))
    revised = [max(abs(o) - threshold * d, 0.0) * math.copysign(1.0, o) if o else 0.0 for o, d in zip(offset, dims)]
    if all(abs(r) < 1e-3 for r in revised):
        return set()
    norm = math.hypot(*offset)
    dx, dy = revised[0] / norm, revised[1] / norm
    return {name for name, on in (("left of", dx < -0.5), ("right of", dx > 0.5), ("above", dy < -0.5),
                                  ("below", dy > 0.5)) if on}


def evaluate(detected: Detections, metadata: dict, colour_of: Callable[[str, list[Box]], list[str]],
             position_threshold: float = 0.1) -> tuple[bool, int, int]:
    """GenEval's verdict on one image.

    Args:
        detected (`dict`): class -> kept detections ``[(box, confidence)]``, most confident first (see [`select`]).
        metadata (`dict`): the prompt's ``include`` / ``exclude`` clauses.
        colour_of (`Callable`): ``(class, boxes) -> colours``, one of `COLORS` per box.
        position_threshold (`float`, defaults to 0.1): see [`relative_position`].

    Returns:
        `tuple`: ``(correct, clauses that hold, clauses)``.
    """
    passed, matched_groups = 0, []
    includes, excludes = metadata.get("include", []), metadata.get("exclude", [])
    for clause in includes:
        found = [box for box, _ in detected.get(clause["class"], [])[: clause["count"]]]
        matched = len(found) >= clause["count"]
        if matched and "color" in clause:
            matched = colour_of(clause["class"], found).count(clause["color"]) >= clause["count"]
        if matched and "position" in clause:
            relation, group = clause["position"]
            targets = matched_groups[group]
            matched = targets is not None and all(
                relation in relative_position(box, target, position_threshold) for box in found for target in targets
            )
        matched_groups.append(found if matched else None)
        passed += matched
    for clause in excludes:
        passed += len(detected.get(clause["class"], [])) < clause["count"]
    total = len(includes) + len(excludes)
    return passed == total, passed, total


def check_metadata(metadata: dict) -> bool:
    """Whether `metadata` holds GenEval clauses this rule can read (classes, positive counts, known colours and
    relations, positions naming an earlier clause); anything else is scored NaN, not an error."""
    includes, excludes = metadata.get("include"), metadata.get("exclude", [])
    if not isinstance(includes, list) or not includes or not isinstance(excludes, list):
        return False
    for j, clause in enumerate(includes + excludes):
        if not isinstance(clause, dict) or not isinstance(clause.get("class"), str):
            return False
        count = clause.get("count")
        if not isinstance(count, int) or isinstance(count, bool) or count < 1:
            return False
        if "color" in clause and clause["color"] not in COLORS:
            return False
        position = clause.get("position")
        if position is not None and not (
            isinstance(position, (list, tuple)) and len(position) == 2 and position[0] in RELATIONS
            and isinstance(position[1], int) and 0 <= position[1] < min(j, len(includes))
        ):
            return False
    return True
