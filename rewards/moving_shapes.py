"""Programmatic reward for the moving-shapes text-to-video task: checks every frame and the motion from the pixels.

Each frame goes through the shape detector of `mmgrpo.rewards.mini_geneval` (nearest palette colour, 8-connected
components, shape from the component's geometry). Checks of a prompt (metadata from `mmgrpo.data.moving_shapes`),
each true or false for the whole clip:

- ``shape``: in every frame, some object has the prompt's shape;
- ``color``: in every frame, some object has the prompt's shape and colour;
- ``count``: in every frame, exactly `count` objects have that shape and colour (``counting`` prompts, or all prompts
  with `exact_scene`);
- ``total``: in every frame, no other object is drawn (with `exact_scene`);
- ``motion``: the objects of the prompt's shape and colour (in every frame at least one; their mean centroid ``c_f``
  and total area ``a_f`` in frame ``f``) move as asked. For a translation along unit direction ``d`` (``right`` is
  +x, ``down`` is +y, in pixels), with ``e`` the perpendicular::

      (c_last - c_first) . d >= motion_margin * side,   |(c_last - c_first) . e| <= (c_last - c_first) . d / 2,
      (c_{f+1} - c_f) . d >= -step_tolerance * side for every f,   1 / scale_ratio <= a_last / a_first <= scale_ratio

  (travels far enough, mainly along ``d``, never back, without changing size). ``growing`` needs
  ``a_last / a_first >= scale_ratio`` and ``|c_last - c_first| < motion_margin * side`` (it stays in place),
  ``shrinking`` the same with ``a_first / a_last``.

The reward's ``partial`` score is the share of the prompt's checks passed, ``strict`` is 1 when all pass. With
``shape_slack > 0`` the ``shape`` check counts in ``partial`` as a graded credit instead of 0 / 1: per frame, the best
object of the prompt's colour scores 1 if the detector calls it the prompt's shape, else ``max(0, 1 - d / shape_slack)``
with ``d`` its `shape_distance` to that shape's region (fill, bottom-heaviness, aspect); the credit is the mean over
frames. A blob that is almost a square then earns part of the check, which gives a group something to rank where no
member draws an exact square yet; ``strict`` is unchanged. What it does
not check: the speed profile within a clip (only the direction of every step), object sizes beyond the area ratio,
and which object is which across frames (groups of objects are compared through their mean centroid and total area).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from mmgrpo.rewards._common import fixed_artifacts, fixed_modalities
from mmgrpo.data.moving_shapes import TRANSLATIONS
from mmgrpo.rewards.mini_geneval import MiniGenEval, shape_distance
from mmgrpo.types import PromptBatch, RewardResult
from mmgrpo.validation import check_fields, check_range

# every check a prompt can have; `components` always holds all of them (NaN where a prompt lacks one)
CHECK_NAMES = ("shape", "color", "count", "total", "motion")
SHAPE_CREDIT = "shape_credit"  # the graded shape check, a component when `shape_slack > 0`


@dataclass
class MovingShapesRewardConfig:
    """Configuration of [`MovingShapesReward`].

    Args:
        score (`str`, defaults to `"partial"`): the reward, ``"partial"`` (share of the prompt's checks passed) or
            ``"strict"`` (1 if all pass, else 0). Both are always in `components`.
        exact_scene (`bool`, defaults to `True`): also require the exact count of every prompt and no other object in
            every frame (without it, extra objects go unnoticed and a policy learns to draw them).
        shape_slack (`float`, defaults to 0.0): above 0, ``partial`` counts the ``shape`` check as a graded credit
            that falls to 0 at this `shape_distance` from the shape's region (module docstring), e.g. 0.3; 0 keeps
            it a 0 / 1 check. ``strict`` never changes.
        motion_margin (`float`, defaults to 0.12): smallest travel of a translation, and the largest drift of a
            scaling, as a share of the frame side (3.8 px at 32 x 32; rendered clips travel 8-11 px).
        scale_ratio (`float`, defaults to 1.5): smallest area ratio of growing / shrinking (rendered: 2 or more), and
            the largest size change allowed during a translation.
        step_tolerance (`float`, defaults to 0.03): largest step backwards between two frames of a translation, as a
            share of the side (1 px at 32 x 32).
        color_threshold (`float`, defaults to 0.35): largest RGB distance to a palette colour (see `MiniGenEval`).
        min_area (`float`, defaults to 0.012): smallest object, as a share of the frame (see `MiniGenEval`).
        max_area (`float`, defaults to 0.5): larger components are background (see `MiniGenEval`).
    """

    score: str = "partial"
    exact_scene: bool = True
    shape_slack: float = 0.0
    motion_margin: float = 0.12
    scale_ratio: float = 1.5
    step_tolerance: float = 0.03
    color_threshold: float = 0.35
    min_area: float = 0.012
    max_area: float = 0.5

    def __post_init__(self):
        check_fields(self)
        if self.score not in ("partial", "strict"):
            raise ValueError(f"MovingShapesRewardConfig.score must be 'partial' or 'strict', got {self.score!r}.")
        check_range("motion_margin", self.motion_margin, 0.0, 0.5, low_open=True, fix="a share of the frame side")
        check_range("shape_slack", self.shape_slack, 0.0, 10.0, fix="0 (exact checks) or a distance such as 0.3")
        check_range("scale_ratio", self.scale_ratio, 1.0, 10.0, low_open=True, fix="an area ratio above 1, e.g. 1.5")
        check_range("step_tolerance", self.step_tolerance, 0.0, 0.5, fix="a share of the frame side")
        # the detector's own options are validated by MiniGenEval.Config when the reward is built


class MovingShapesReward:
    """Moving-shapes clip checker, from pixels only (see the module docstring for the checks)."""

    Config = MovingShapesRewardConfig
    modalities = frozenset({"video"})
    group_stage = None  # each score depends on its sample only (see mmgrpo.protocols.RewardFn)
    artifacts = frozenset()  # adds nothing for the sample writers

    modalities_for = classmethod(fixed_modalities)  # see mmgrpo.protocols.RewardFn
    artifacts_for = classmethod(fixed_artifacts)

    def __init__(self, config: MovingShapesRewardConfig | None = None):
        self.config = config or MovingShapesRewardConfig()
        self.detector = MiniGenEval(MiniGenEval.Config(
            color_threshold=self.config.color_threshold, min_area=self.config.min_area,
            max_area=self.config.max_area,
        ))

    def detect(self, videos: torch.Tensor) -> list[list[list[dict]]]:
        """Objects per clip and frame (``{"color", "shape", "area", "cx", "cy"}``, as `MiniGenEval.detect`).

        Args:
            videos (`torch.FloatTensor` of shape `[N, F, 3, H, W]`): values in [0, 1].
        """
        n, f = videos.shape[:2]
        flat = self.detector.detect(videos.reshape(n * f, *videos.shape[2:]))  # N * F lists
        return [flat[i * f : (i + 1) * f] for i in range(n)]

    def checks(self, frames: list[list[dict]], metadata: dict, side: int) -> dict[str, bool]:
        """Evaluates the checks of a prompt on the detected objects of every frame of one clip."""
        spec = metadata["objects"][0]
        same_shape = [[o for o in objects if o["shape"] == spec["shape"]] for objects in frames]
        matching = [[o for o in objs if o["color"] == spec["color"]] for objs in same_shape]
        result = {"shape": all(same_shape), "color": all(matching)}
        if self.config.exact_scene or metadata["kind"] == "counting":
            result["count"] = all(len(objs) == spec["count"] for objs in matching)
        if self.config.exact_scene:
            result["total"] = all(len(objects) == spec["count"] for objects in frames)
        result["motion"] = all(matching) and self._motion(matching, metadata["motion"], side)
        return result

    def shape_credit(self, frames: list[list[dict]], spec: dict) -> float:
        """The graded ``shape`` check of one clip (module docstring): mean over frames of the best credit of an object
        of the prompt's colour (0 in a frame without one). An object the detector calls the prompt's shape lies in
        that shape's region, at `shape_distance` 0, so it scores 1."""
        slack = self.config.shape_slack
        per_frame = []
        for objects in frames:
            credits = [max(0.0, 1.0 - shape_distance(o, spec["shape"]) / slack)
                       for o in objects if o["color"] == spec["color"]]
            per_frame.append(max(credits, default=0.0))
        return sum(per_frame) / len(per_frame)

    def _motion(self, matching: list[list[dict]], motion: str, side: int) -> bool:
        centres = torch.tensor([[sum(o[k] for o in objs) / len(objs) for k in ("cx", "cy")] for objs in matching])
        areas = torch.tensor([sum(o["area"] for o in objs) for objs in matching])  # [F]
        travel = centres[-1] - centres[0]  # [2] (x, y) in pixels
        ratio = float(areas[-1] / areas[0])
        margin = self.config.motion_margin * side
        if motion in TRANSLATIONS:
            d = torch.tensor(TRANSLATIONS[motion], dtype=torch.float32)  # [2] unit direction
            e = torch.stack([-d[1], d[0]])  # [2] perpendicular
            along, across = float(travel @ d), float(travel @ e)
            steps = (centres[1:] - centres[:-1]) @ d  # [F - 1]
            return (along >= margin and abs(across) <= along / 2
                    and bool((steps >= -self.config.step_tolerance * side).all())
                    and 1 / self.config.scale_ratio <= ratio <= self.config.scale_ratio)
        grown = ratio if motion == "growing" else 1 / ratio
        return grown >= self.config.scale_ratio and float(travel.norm()) < margin

    def __call__(self, outputs: dict[str, Any], batch: PromptBatch) -> RewardResult:
        """Scores ``outputs["videos"]`` (`[N, F, 3, H, W]` in [0, 1]) against ``batch.metadata``.

        Returns:
            [`RewardResult`]: `scores` `[N]` (partial or strict, as configured) and `components` ``strict``,
            ``partial`` and ``check_<name>`` for each name in `CHECK_NAMES` (NaN where a prompt has no such check),
            plus ``shape_credit`` when `shape_slack > 0`. Samples whose metadata is not a moving-shapes prompt (no
            ``"motion"``) score NaN; malformed videos score 0.
        """
        videos = outputs["videos"]
        n = len(batch.metadata)
        partial = torch.full((n,), float("nan"))
        strict = torch.full((n,), float("nan"))
        per_check = {f"check_{name}": torch.full((n,), float("nan")) for name in CHECK_NAMES}
        credit = torch.full((n,), float("nan"))  # [N] graded shape check (shape_slack > 0)
        usable = (isinstance(videos, torch.Tensor) and videos.dim() == 5 and videos.shape[0] == n
                  and videos.shape[2] == 3 and videos.shape[1] >= 2)
        if usable:
            videos = torch.nan_to_num(videos.detach().float().cpu(), nan=0.0)
        detected = self.detect(videos) if usable and n > 0 else [None] * n
        side = int(videos.shape[-1]) if usable else 32
        for i, metadata in enumerate(batch.metadata):
            if not metadata.get("motion") or not metadata.get("objects"):
                continue
            checks = self.checks(detected[i], metadata, side) if usable else {"video": False}
            credits = {**checks}
            if usable and self.config.shape_slack > 0:
                credits["shape"] = credit[i] = self.shape_credit(detected[i], metadata["objects"][0])
            partial[i] = sum(float(v) for v in credits.values()) / len(credits)
            strict[i] = float(all(checks.values()))
            for name, ok in checks.items():
                if f"check_{name}" in per_check:
                    per_check[f"check_{name}"][i] = float(ok)
        scores = partial if self.config.score == "partial" else strict
        components = {"strict": strict, "partial": partial, **per_check}
        if self.config.shape_slack > 0:
            components[SHAPE_CREDIT] = credit
        return RewardResult(scores=scores.float(), components={k: v.float() for k, v in components.items()})


PLUGIN = MovingShapesReward
