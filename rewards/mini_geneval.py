"""Programmatic GenEval-like reward for the shapes task: finds coloured shapes in the pixels and checks the prompt.

Like GenEval checks the output of an object detector, this checks the output of a tiny hand-written detector:

1. each pixel takes the nearest palette colour (or the background) when it is close enough, else it is ignored;
2. pixels of one colour are grouped into 8-connected components; components smaller than `min_area` or larger
   than `max_area` are dropped;
3. a component's shape comes from its geometry: the share of its bounding box it fills (square ~1.0, circle
   ~0.78, triangle ~0.5), whether its area is mostly in the lower half (upward triangles: ~3/4) and the aspect
   ratio of its bounding box (from 0.6 to 1/0.6, else ``"other"``);
4. the prompt's checks are evaluated on the detected objects.

Checks of a prompt (its metadata comes from `mmgrpo.data.shapes`), as GenEval's: for every object
``(color, shape, count)`` of the prompt, ``shape_<j>`` (some object has that shape) and ``color_<j>`` (some object
has that shape and colour); for ``counting`` prompts ``count_0`` (exactly `count` objects have that shape and
colour); for ``position`` prompts ``relation`` (the centroid of the largest first object is on the stated side of
the largest second one, by at least `relation_margin` and more along that axis than across it). Other objects in
the image are ignored, as in GenEval. A single-object prompt has 2 checks, counting 3, two objects 4, position 5.
With ``exact_scene=True``, every object also gets ``count_<j>`` and the image gets ``total`` (no other object).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from mmgrpo.rewards._common import fixed_artifacts, fixed_modalities
from mmgrpo.data.shapes import BACKGROUND, PALETTE
from mmgrpo.types import PromptBatch, RewardResult
from mmgrpo.validation import check_fields

_COLORS = tuple(PALETTE)
# every check a prompt can have; `components` always holds all of them (NaN where a prompt lacks one)
CHECK_NAMES = ("shape_0", "color_0", "count_0", "shape_1", "color_1", "count_1", "total", "relation")
_RGB = torch.tensor([BACKGROUND, *PALETTE.values()], dtype=torch.float32) / 255  # [1 + K, 3], row 0 = background
# a component is "other" unless its bounding box's width / height lies in [ASPECT_RANGE[0], ASPECT_RANGE[1]]
ASPECT_RANGE = (0.6, 1 / 0.6)
_LOG_ASPECT = math.log(ASPECT_RANGE[1])
# the region of each shape in (fill, bottom_heavy): half-open ranges [low, high); the regions do not overlap
SHAPE_REGIONS = {
    "triangle": {"fill": (0.3, 0.85), "bottom_heavy": (0.62, float("inf"))},
    "square": {"fill": (0.88, float("inf")), "bottom_heavy": (float("-inf"), 0.62)},
    "circle": {"fill": (0.55, 0.88), "bottom_heavy": (float("-inf"), 0.62)},
}


def classify_shape(fill: float, bottom_heavy: float, aspect: float) -> str:
    """The detector's shape of a component from its geometry: the `SHAPE_REGIONS` entry holding ``(fill,
    bottom_heavy)`` when `aspect` is within `ASPECT_RANGE`, else ``"other"``."""
    if ASPECT_RANGE[0] <= aspect <= ASPECT_RANGE[1]:
        for name, region in SHAPE_REGIONS.items():
            if region["fill"][0] <= fill < region["fill"][1] and \
                    region["bottom_heavy"][0] <= bottom_heavy < region["bottom_heavy"][1]:
                return name
    return "other"


def shape_distance(obj: dict, shape: str) -> float:
    """How far the geometry of a detected object (``fill``, ``bottom_heavy``, ``aspect``, as `MiniGenEval.detect`
    returns them) lies outside the detector's region of `shape`: the sum over the three features of the distance to
    their allowed range (the aspect ratio in log space); 0 inside the region and on its boundary."""
    region = {**SHAPE_REGIONS[shape], "log_aspect": (-_LOG_ASPECT, _LOG_ASPECT)}
    values = {"fill": obj["fill"], "bottom_heavy": obj["bottom_heavy"], "log_aspect": math.log(obj["aspect"])}
    distance = 0.0
    for name, (low, high) in region.items():
        distance += max(0.0, low - values[name]) + max(0.0, values[name] - high)
    return distance


def _connected_components(classes: torch.Tensor) -> torch.Tensor:
    """8-connected components of equal non-zero class, by repeated min-label propagation.

    Args:
        classes (`torch.LongTensor` of shape `[N, H, W]`): 0 for background, else a colour index.

    Returns:
        `torch.LongTensor` of shape `[N, H, W]`: a component id per pixel (unique over the batch), -1 on background.
    """
    n, h, w = classes.shape
    big = n * h * w
    ids = torch.arange(big, dtype=torch.long).view(n, h, w)
    labels = torch.where(classes > 0, ids, torch.full_like(ids, big))  # [N, H, W]
    padded_classes = F.pad(classes, (1, 1, 1, 1), value=-1)  # [N, H + 2, W + 2]
    shifts = [(dy, dx) for dy in (0, 1, 2) for dx in (0, 1, 2) if (dy, dx) != (1, 1)]
    same = [padded_classes[:, dy : dy + h, dx : dx + w] == classes for dy, dx in shifts]  # 8 x [N, H, W]
    for _ in range(h * w):
        padded = F.pad(labels, (1, 1, 1, 1), value=big)
        new = labels
        for (dy, dx), keep in zip(shifts, same):
            neighbour = padded[:, dy : dy + h, dx : dx + w]
            new = torch.minimum(new, torch.where(keep, neighbour, big))
        new = torch.where(classes > 0, new, big)
        if torch.equal(new, labels):
            break
        labels = new
    return torch.where(labels == big, -1, labels)


@dataclass
class MiniGenEvalConfig:
    """Configuration of [`MiniGenEval`].

    Args:
        score (`str`, defaults to `"partial"`): the reward, ``"partial"`` (share of the prompt's checks passed)
            or ``"strict"`` (1 if all pass, else 0). Both are always in `components`.
        color_threshold (`float`, defaults to 0.35): largest RGB distance (channels in [0, 1]) from a palette
            colour for a pixel to take that colour; the palette colours are >= 0.78 apart.
        min_area (`float`, defaults to 0.012): smallest object area as a share of the image (12 px at 32x32;
            the smallest rendered object covers ~32 px).
        max_area (`float`, defaults to 0.5): components covering more than this share of the image are
            treated as background, not objects (the largest rendered object covers 25%).
        exact_scene (`bool`, defaults to `False`): also require exact counts for every object and no other
            object (stricter than GenEval).
        relation_margin (`float`, defaults to 0.06): smallest centroid offset for a spatial relation, as a share
            of the image side (2 px at 32x32).
    """

    score: str = "partial"
    color_threshold: float = 0.35
    min_area: float = 0.012
    max_area: float = 0.5
    relation_margin: float = 0.06
    exact_scene: bool = False

    def __post_init__(self):
        check_fields(self)
        if self.score not in ("partial", "strict"):
            raise ValueError(f"MiniGenEval.Config.score must be 'partial' or 'strict', got {self.score!r}.")
        if not 0.0 < self.color_threshold < 0.78:
            raise ValueError(
                f"MiniGenEval.Config.color_threshold must be in (0, 0.78) (half the palette spacing is ~0.39), "
                f"got {self.color_threshold}."
            )
        if not 0.0 <= self.min_area < 0.5:
            raise ValueError(
                f"MiniGenEval.Config.min_area is a share of the image in [0, 0.5), got {self.min_area}."
            )
        if not self.min_area < self.max_area <= 1.0:
            raise ValueError(
                f"MiniGenEval.Config.max_area must be in (min_area, 1], got {self.max_area} "
                f"(min_area {self.min_area})."
            )
        if not 0.0 <= self.relation_margin < 0.5:
            raise ValueError(
                f"MiniGenEval.Config.relation_margin is a share of the image side in [0, 0.5), "
                f"got {self.relation_margin}."
            )


class MiniGenEval:
    """GenEval-like checker of shapes-task images, from pixels only (see the module docstring for the checks)."""

    Config = MiniGenEvalConfig
    modalities = frozenset({"image"})
    group_stage = None  # each score depends on its sample only (see mmgrpo.protocols.RewardFn)
    artifacts = frozenset()  # adds nothing for the sample writers

    modalities_for = classmethod(fixed_modalities)  # see mmgrpo.protocols.RewardFn
    artifacts_for = classmethod(fixed_artifacts)

    def __init__(self, config: MiniGenEvalConfig | None = None):
        self.config = config or MiniGenEvalConfig()

    # --------------------------------------------------------------------------------------------- detection

    def detect(self, images: torch.Tensor) -> list[list[dict]]:
        """Finds the objects in a batch of images.

        Args:
            images (`torch.FloatTensor` of shape `[N, 3, H, W]`): values in [0, 1] (NaNs count as 0).

        Returns:
            `list[list[dict]]`: per image, the objects ``{"color", "shape", "area", "cx", "cy", "fill",
            "bottom_heavy", "aspect"}`` (``shape`` may be ``"other"``; ``cx``/``cy`` are the centroid in pixels;
            ``fill`` the share of the bounding box covered, ``bottom_heavy`` the share of the area below the box's
            middle row, ``aspect`` width / height).
        """
        images = torch.nan_to_num(images.detach().float().cpu(), nan=0.0).clamp(0, 1)  # [N, 3, H, W]
        n, _, h, w = images.shape
        pixels = images.permute(0, 2, 3, 1).reshape(n, h * w, 3)  # [N, HW, 3]
        dist = torch.cdist(pixels, _RGB[None].expand(n, -1, -1))  # [N, HW, 1 + K]
        best, classes = dist.min(dim=-1)  # [N, HW]
        classes = torch.where(best <= self.config.color_threshold, classes, 0).view(n, h, w)  # [N, H, W]
        labels = _connected_components(classes)  # [N, H, W]
        min_area = max(1, round(self.config.min_area * h * w))
        max_area = self.config.max_area * h * w
        ys, xs = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")  # [H, W] each
        found = []
        for i in range(n):
            ids, counts = torch.unique(labels[i], return_counts=True)
            objects = []
            for label in ids[(ids >= 0) & (counts >= min_area) & (counts <= max_area)].tolist():
                mask = labels[i] == label  # [H, W]
                objects.append(self._describe(mask, ys[mask].float(), xs[mask].float(), int(classes[i][mask][0])))
            found.append(objects)
        return found

    @staticmethod
    def _describe(mask: torch.Tensor, ys: torch.Tensor, xs: torch.Tensor, color_index: int) -> dict:
        area = float(mask.sum())
        height = float(ys.max() - ys.min() + 1)
        width = float(xs.max() - xs.min() + 1)
        fill = area / (height * width)
        middle = (ys.min() + ys.max()) / 2
        below, above = float((ys > middle).sum()), float((ys < middle).sum())
        bottom_heavy = below / max(below + above, 1.0)  # ~0.75 for an upward triangle, ~0.5 for the others
        aspect = width / height
        shape = classify_shape(fill, bottom_heavy, aspect)
        return {"color": _COLORS[color_index - 1], "shape": shape, "area": area, "cx": float(xs.mean()),
                "cy": float(ys.mean()), "fill": fill, "bottom_heavy": bottom_heavy, "aspect": aspect}

    # --------------------------------------------------------------------------------------------- checks

    def checks(self, objects: list[dict], metadata: dict, image_side: int) -> dict[str, bool]:
        """Evaluates the checks of a prompt on the detected `objects` of one image (see the module docstring)."""
        exact = self.config.exact_scene
        result = {}
        for j, spec in enumerate(metadata["objects"]):
            same_shape = [o for o in objects if o["shape"] == spec["shape"]]
            matching = [o for o in same_shape if o["color"] == spec["color"]]
            result[f"shape_{j}"] = len(same_shape) > 0
            result[f"color_{j}"] = len(matching) > 0
            if exact or metadata["kind"] == "counting":
                result[f"count_{j}"] = len(matching) == spec["count"]
        if exact:
            result["total"] = len(objects) == sum(spec["count"] for spec in metadata["objects"])
        if metadata["kind"] == "position":
            result["relation"] = self._relation(objects, metadata, image_side)
        return result

    def _relation(self, objects: list[dict], metadata: dict, image_side: int) -> bool:
        largest = []
        for spec in metadata["objects"][:2]:
            matching = [o for o in objects if o["shape"] == spec["shape"] and o["color"] == spec["color"]]
            if not matching:
                return False
            largest.append(max(matching, key=lambda o: o["area"]))
        a, b = largest
        dx, dy = a["cx"] - b["cx"], a["cy"] - b["cy"]
        main, across = {"left_of": (-dx, dy), "right_of": (dx, dy), "above": (-dy, dx), "below": (dy, dx)}[
            metadata["relation"]
        ]
        return main >= self.config.relation_margin * image_side and main > abs(across)

    # --------------------------------------------------------------------------------------------- reward

    def __call__(self, outputs: dict[str, Any], batch: PromptBatch) -> RewardResult:
        """Scores ``outputs["images"]`` (`[N, 3, H, W]` in [0, 1]) against ``batch.metadata``.

        Returns:
            [`RewardResult`]: `scores` `[N]` (partial or strict, as configured) and `components` ``strict``,
            ``partial`` and ``check_<name>`` for each name in `CHECK_NAMES` (NaN where a prompt has no such check).
            Samples whose metadata is not a shapes prompt (no ``"objects"``) score NaN. Malformed images score 0.
        """
        images = outputs["images"]
        n = len(batch.metadata)
        partial = torch.full((n,), float("nan"))
        strict = torch.full((n,), float("nan"))
        per_check = {f"check_{name}": torch.full((n,), float("nan")) for name in CHECK_NAMES}
        usable = isinstance(images, torch.Tensor) and images.dim() == 4 and images.shape[:2] == (n, 3)
        detected = self.detect(images) if usable and n > 0 else [[] for _ in range(n)]
        side = int(images.shape[-1]) if usable else 32
        for i, metadata in enumerate(batch.metadata):
            if not metadata.get("objects"):
                continue
            checks = self.checks(detected[i], metadata, side) if usable else {"image": False}
            partial[i] = sum(checks.values()) / len(checks)
            strict[i] = float(all(checks.values()))
            for name, ok in checks.items():
                if f"check_{name}" in per_check:
                    per_check[f"check_{name}"][i] = float(ok)
        scores = partial if self.config.score == "partial" else strict
        components = {"strict": strict, "partial": partial, **per_check}
        return RewardResult(scores=scores.float(), components={k: v.float() for k, v in components.items()})


PLUGIN = MiniGenEval
