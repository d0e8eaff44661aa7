"""The moving-shapes video reward: rendered clips pass, each kind of mistake fails its own check, hand-built clips."""

import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from PIL import Image, ImageDraw

from mmgrpo import registry
from mmgrpo.data.moving_shapes import all_metadata, prompt_from_metadata, render_clip
from mmgrpo.data.shapes import PALETTE, _draw
from mmgrpo.rewards.mini_geneval import SHAPE_REGIONS, classify_shape, shape_distance
from mmgrpo.rewards.moving_shapes import CHECK_NAMES, MovingShapesReward
from mmgrpo.types import PromptBatch


def _meta(color="red", shape="square", count=1, motion="right"):
    kind = "single" if count == 1 else "counting"
    return {"kind": kind, "objects": [{"color": color, "shape": shape, "count": count}], "motion": motion}


def _score(videos, metadata, **options):
    reward = MovingShapesReward(MovingShapesReward.Config(**options))
    metadata = metadata if isinstance(metadata, list) else [metadata]
    videos = videos if videos.dim() == 5 else videos[None]
    prompts = [prompt_from_metadata(m) if "motion" in m else "another task" for m in metadata]
    return reward({"videos": videos}, PromptBatch(prompts, metadata))


def _clip(frames_of_boxes, size=32):
    """Hand-built clip: per frame a list of ``(shape, color, x, y, side)``; `[F, 3, H, W]` in [0, 1]."""
    frames = []
    for boxes in frames_of_boxes:
        image = Image.new("RGB", (size, size), (0, 0, 0))
        draw = ImageDraw.Draw(image)
        for shape, color, x, y, s in boxes:
            _draw(draw, shape, x, y, s, PALETTE[color])
        frames.append(torch.from_numpy(np.asarray(image)).permute(2, 0, 1).float() / 255)
    return torch.stack(frames)


def _checks(result, i=0):
    return {name: result.components[f"check_{name}"][i].item() for name in CHECK_NAMES}


def test_registered_for_videos():
    assert registry.get("reward", "moving_shapes") is MovingShapesReward
    assert MovingShapesReward.modalities == frozenset({"video"}) and MovingShapesReward.group_stage is None


@pytest.mark.parametrize("seed", [0, 1])
def test_rendered_clips_of_every_prompt_are_strictly_correct(seed):
    metadata = all_metadata()
    rng = np.random.default_rng(seed)
    videos = torch.stack([render_clip(m, rng) for m in metadata])  # [324, 5, 3, 32, 32]
    result = _score(videos, metadata, score="strict")
    assert result.scores.tolist() == [1.0] * len(metadata)
    assert torch.equal(result.components["partial"], torch.ones(len(metadata)))


def test_nine_frame_clips_at_48_pixels_also_pass():
    metadata = all_metadata(motions=("left", "shrinking"))
    rng = np.random.default_rng(2)
    videos = torch.stack([render_clip(m, rng, size=48, num_frames=9) for m in metadata])
    assert _score(videos, metadata, score="strict").scores.min().item() == 1.0


def test_hand_built_translation():
    """A 10 px red square at x = 4, 6, 8, 10, 12 (y = 10): travel 8 px >= 0.12 * 32 = 3.84, never back: all pass."""
    clip = _clip([[("square", "red", 4 + 2 * f, 10, 10)] for f in range(5)])
    result = _score(clip, _meta())
    assert _checks(result) == {"shape": 1.0, "color": 1.0, "count": 1.0, "total": 1.0, "motion": 1.0}
    assert result.scores.item() == 1.0
    # the same clip asked to move left / up / down / grow fails the motion check only: partial 4 / 5
    for motion in ("left", "up", "down", "growing", "shrinking"):
        result = _score(clip, _meta(motion=motion))
        assert _checks(result)["motion"] == 0.0
        assert result.scores.item() == pytest.approx(4 / 5)
        assert result.components["strict"].item() == 0.0


def test_too_short_backwards_or_resizing_translation_fails_motion():
    short = _clip([[("square", "red", 10 + (f > 2), 10, 10)] for f in range(5)])  # 1 px in total < 3.84
    back = _clip([[("square", "red", x, 10, 10)] for x in (4, 10, 6, 12, 14)])  # 10 px, but one step 4 px back
    diagonal = _clip([[("square", "red", 4 + 2 * f, 4 + 2 * f, 10)] for f in range(5)])  # as far down as right
    resizing = _clip([[("square", "red", 2 + 2 * f, 8, s)] for f, s in enumerate((8, 9, 10, 11, 12))])  # area x 2.25
    static = _clip([[("square", "red", 10, 10, 10)]] * 5)
    for clip in (short, back, diagonal, resizing, static):
        checks = _checks(_score(clip, _meta()))
        assert checks["motion"] == 0.0 and checks["shape"] == checks["color"] == checks["total"] == 1.0
    # a step back is allowed up to step_tolerance * side: 1 px back fails at 0.03 (0.96 px), passes at 0.05 (1.6 px)
    wobble = _clip([[("square", "red", x, 10, 10)] for x in (4, 8, 7, 10, 12)])
    assert _checks(_score(wobble, _meta()))["motion"] == 0.0
    assert _checks(_score(wobble, _meta(), step_tolerance=0.05))["motion"] == 1.0


def test_hand_built_growing_and_shrinking():
    """A green circle centred at (15.5, 15.5) growing from 7 to 13 px: area ratio >> 1.5, no drift."""
    sides = (7, 9, 11, 13, 13)
    clip = _clip([[("circle", "green", 16 - (s + 1) // 2, 16 - (s + 1) // 2, s)] for s in sides])
    assert _checks(_score(clip, _meta("green", "circle", motion="growing")))["motion"] == 1.0
    assert _checks(_score(clip.flip(0), _meta("green", "circle", motion="shrinking")))["motion"] == 1.0
    assert _checks(_score(clip, _meta("green", "circle", motion="shrinking")))["motion"] == 0.0
    # growing while moving away (centroid drift 8 px >= 3.84) is not "growing"
    drifting = _clip([[("circle", "green", 4 + 2 * f, 10, s)] for f, s in enumerate(sides)])
    assert _checks(_score(drifting, _meta("green", "circle", motion="growing")))["motion"] == 0.0
    # a growth of 8 -> 9 px (area ratio ~1.3 < 1.5) is too small
    small = _clip([[("circle", "green", 12, 12, s)] for s in (8, 8, 9, 9, 9)])
    assert _checks(_score(small, _meta("green", "circle", motion="growing")))["motion"] == 0.0


def test_wrong_colour_fails_colour_not_shape():
    clip = render_clip(_meta("blue", "triangle", 1, "down"), np.random.default_rng(0))
    checks = _checks(_score(clip, _meta("red", "triangle", 1, "down")))
    assert checks["shape"] == 1.0 and checks["total"] == 1.0
    assert checks["color"] == 0.0 and checks["count"] == 0.0 and checks["motion"] == 0.0


def test_wrong_count_fails_count_and_total():
    clip = render_clip(_meta("cyan", "circle", 2, "up"), np.random.default_rng(0))
    result = _score(clip, _meta("cyan", "circle", 3, "up"))
    checks = _checks(result)
    assert checks == {"shape": 1.0, "color": 1.0, "count": 0.0, "total": 0.0, "motion": 1.0}
    assert result.scores.item() == pytest.approx(3 / 5)


def test_an_extra_object_in_one_frame_fails_total_only_with_exact_scene():
    frames = [[("square", "red", 2 + 2 * f, 4, 9)] for f in range(5)]
    frames[3].append(("circle", "yellow", 4, 20, 9))  # an extra yellow circle in frame 3 only
    clip = _clip(frames)
    checks = _checks(_score(clip, _meta()))
    assert checks == {"shape": 1.0, "color": 1.0, "count": 1.0, "total": 0.0, "motion": 1.0}
    # GenEval's rule (no exact scene) ignores it; a single prompt then has shape, colour and motion checks only
    loose = _score(clip, _meta(), exact_scene=False)
    assert loose.scores.item() == 1.0 and math.isnan(loose.components["check_total"].item())
    assert math.isnan(loose.components["check_count"].item())
    # counting prompts keep their count check without the exact scene
    two = _clip([[("square", "red", 2 + 2 * f, 4, 8), ("square", "red", 2 + 2 * f, 18, 8)] for f in range(5)])
    assert _checks(_score(two, _meta(count=3), exact_scene=False))["count"] == 0.0


def test_an_object_missing_in_one_frame_fails_every_frame_check():
    frames = [[("square", "red", 2 + 2 * f, 4, 9)] for f in range(5)]
    frames[2] = []
    checks = _checks(_score(_clip(frames), _meta()))
    assert checks == {"shape": 0.0, "color": 0.0, "count": 0.0, "total": 0.0, "motion": 0.0}


def test_batch_other_tasks_and_malformed_videos():
    rng = np.random.default_rng(4)
    good = render_clip(_meta("magenta", "square", 3, "left"), rng)
    metadata = [_meta("magenta", "square", 3, "left"), {"objects": [{"color": "red"}]}, _meta()]
    videos = torch.stack([good, good, torch.zeros_like(good)])
    result = _score(videos, metadata, score="strict")
    assert result.scores[0].item() == 1.0 and math.isnan(result.scores[1].item()) and result.scores[2].item() == 0.0
    assert math.isnan(result.components["check_motion"][1].item())
    bad = _score(torch.zeros(1, 5, 3, 32), _meta())  # [N, F, 3, H] is not a video
    assert bad.scores.item() == 0.0
    nan_video = torch.full((1, 5, 3, 32, 32), float("nan"))
    assert _score(nan_video, _meta()).scores.item() == 0.0


@pytest.mark.parametrize("options, key", [
    ({"score": "mean"}, "score"),
    ({"motion_margin": 0.0}, "motion_margin"),
    ({"scale_ratio": 1.0}, "scale_ratio"),
    ({"step_tolerance": -0.1}, "step_tolerance"),
    ({"shape_slack": -0.1}, "shape_slack"),
    ({"colour": 1}, "colour"),
])
def test_bad_config_is_refused_with_the_key(options, key):
    with pytest.raises((ValueError, TypeError), match=key):
        MovingShapesReward.Config(**options)
    with pytest.raises(ValueError, match="color_threshold"):
        MovingShapesReward(MovingShapesReward.Config(color_threshold=0.9))


# ------------------------------------------------------------------------------------------ graded shape credit


def test_shape_distance_by_hand():
    blob = {"fill": 0.80, "bottom_heavy": 0.5, "aspect": 1.0}  # a square with round corners
    assert shape_distance(blob, "circle") == 0.0
    assert shape_distance(blob, "square") == pytest.approx(0.88 - 0.80)
    assert shape_distance(blob, "triangle") == pytest.approx(0.62 - 0.5)
    wide = {"fill": 0.95, "bottom_heavy": 0.5, "aspect": 2.0}
    assert shape_distance(wide, "square") == pytest.approx(math.log(2.0) - math.log(1 / 0.6))
    assert shape_distance(wide, "circle") == pytest.approx((0.95 - 0.88) + math.log(2.0) - math.log(1 / 0.6))


@given(fill=st.floats(0.05, 1.0), bottom_heavy=st.floats(0.0, 1.0), aspect=st.floats(0.3, 3.0))
def test_the_detected_shape_is_at_distance_zero_and_no_other_is(fill, bottom_heavy, aspect):
    blob = {"fill": fill, "bottom_heavy": bottom_heavy, "aspect": aspect}
    detected = classify_shape(fill, bottom_heavy, aspect)
    for shape in SHAPE_REGIONS:
        distance = shape_distance(blob, shape)
        assert distance >= 0.0
        if shape == detected:
            assert distance == 0.0
        elif distance == 0.0:  # only on an open upper boundary of the shape's region
            region = SHAPE_REGIONS[shape]
            assert fill == region["fill"][1] or bottom_heavy == region["bottom_heavy"][1] or detected == "other"


def test_graded_credit_rewards_a_near_square_and_leaves_strict_alone():
    # a red disc moving right, asked for as a square: the detector calls it a circle in every frame
    clip = _clip([[("circle", "red", 4 + 3 * f, 10, 12)] for f in range(5)])
    exact = _score(clip, _meta(shape="square"))
    graded = _score(clip, _meta(shape="square"), shape_slack=0.2)
    reward = MovingShapesReward(MovingShapesReward.Config(shape_slack=0.2))
    frames = reward.detect(clip[None])[0]
    assert all(o["shape"] == "circle" for objects in frames for o in objects)
    by_hand = sum(max(0.0, 1 - (0.88 - objects[0]["fill"]) / 0.2) for objects in frames) / 5
    assert 0.0 < by_hand < 1.0
    assert graded.components["shape_credit"][0].item() == pytest.approx(by_hand, abs=1e-6)
    # checks: shape (graded), colour, count, total, motion; only total passes exactly
    assert exact.components["partial"][0].item() == pytest.approx(1 / 5)
    assert graded.components["partial"][0].item() == pytest.approx((1 + by_hand) / 5, abs=1e-6)
    assert graded.components["strict"][0].item() == exact.components["strict"][0].item() == 0.0
    assert "shape_credit" not in exact.components


def test_graded_credit_is_one_for_the_right_shape_and_zero_without_the_colour():
    clip = _clip([[("square", "red", 4 + 3 * f, 10, 10)] for f in range(5)])
    right = _score(clip, _meta(shape="square"), shape_slack=0.2)
    assert right.components["shape_credit"][0].item() == 1.0 and right.scores[0].item() == 1.0
    other_colour = _score(clip, _meta(color="blue", shape="square"), shape_slack=0.2)
    assert other_colour.components["shape_credit"][0].item() == 0.0
