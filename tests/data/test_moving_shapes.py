"""The synthetic moving-shapes text-to-video task: prompts, metadata, clip rendering, train / held-out split."""

import json

import numpy as np
import pytest
import torch

from mmgrpo import registry
from mmgrpo.data import moving_shapes
from mmgrpo.data.moving_shapes import (
    MOTIONS,
    VOCABULARY,
    MovingShapesPrompts,
    all_metadata,
    clip_boxes,
    prompt_from_metadata,
    render_clip,
)
from mmgrpo.data.shapes import PALETTE, stable_fraction


def _meta(color="red", shape="circle", count=1, motion="right"):
    kind = "single" if count == 1 else "counting"
    return {"kind": kind, "objects": [{"color": color, "shape": shape, "count": count}], "motion": motion}


def test_plugin_is_registered_under_its_file_stem():
    assert moving_shapes.PLUGIN is MovingShapesPrompts
    assert registry.get("data", "moving_shapes") is MovingShapesPrompts


def test_prompts_of_each_kind_and_motion():
    assert prompt_from_metadata(_meta()) == "a red circle moving right"
    assert prompt_from_metadata(_meta("blue", "square", 2, "down")) == "two blue squares moving down"
    assert prompt_from_metadata(_meta("green", "triangle", 1, "growing")) == "a green triangle growing"
    assert prompt_from_metadata(_meta("cyan", "square", 3, "shrinking")) == "three cyan squares shrinking"
    assert prompt_from_metadata(_meta("yellow", "circle", 1, "up")) == "a yellow circle moving up"


def test_enumeration_is_distinct_json_and_uses_vocabulary():
    metadata = all_metadata()
    prompts = [prompt_from_metadata(m) for m in metadata]
    # 6 colours x 3 shapes x 6 motions, for count 1 (single) and counts 2, 3 (counting)
    assert len(set(prompts)) == len(prompts) == 6 * 3 * 6 * 3
    assert json.loads(json.dumps(metadata)) == metadata
    assert {w for p in prompts for w in p.split()} <= set(VOCABULARY)
    assert len(all_metadata(("single",), motions=("left", "growing"))) == 6 * 3 * 2


def test_held_out_prompts_are_never_trained_on():
    source = MovingShapesPrompts(MovingShapesPrompts.Config(n_train=500, n_eval=100))
    train = {it["prompt"] for it in source.train_items()}
    held = {it["prompt"] for it in source.eval_items()}
    assert train and held and not train & held
    assert all(stable_fraction(p) < 0.2 for p in held) and all(stable_fraction(p) >= 0.2 for p in train)
    # every held-out prompt of the pools is drawn before any repeats (100 items > 62 held-out prompts)
    assert held == {prompt_from_metadata(m) for pool in source.eval_pools.values() for m in pool}
    rl_only = MovingShapesPrompts(MovingShapesPrompts.Config(held_out="rl_only", n_train=500, n_eval=100))
    rl_held = {it["prompt"] for it in rl_only.eval_items()}
    assert all(0.2 <= stable_fraction(p) < 0.4 for p in rl_held)


def test_items_alternate_kinds_and_are_deterministic():
    a = MovingShapesPrompts(MovingShapesPrompts.Config(seed=3, n_train=10)).train_items()
    b = MovingShapesPrompts(MovingShapesPrompts.Config(seed=3, n_train=10)).train_items()
    assert a == b
    assert [it["metadata"]["kind"] for it in a[:4]] == ["single", "counting", "single", "counting"]
    assert all(it["prompt"] == prompt_from_metadata(it["metadata"]) for it in a)


def test_translation_clip_by_hand():
    """A red square moving right: every frame has exactly its colour and black, the same area, and the coloured
    pixels' centroid moves right by the clip's travel (a quarter to a third of the side) and not vertically."""
    clip = render_clip(_meta("red", "square", 1, "right"), np.random.default_rng(0), size=32, num_frames=5)
    assert clip.shape == (5, 3, 32, 32) and clip.dtype == torch.float32
    assert 0.0 <= clip.min() and clip.max() <= 1.0
    red = torch.tensor(PALETTE["red"], dtype=torch.float32).view(3, 1, 1) / 255
    is_red = (clip == red).all(dim=1)  # [F, H, W]
    is_black = (clip == 0).all(dim=1)
    assert bool((is_red | is_black).all())
    areas = is_red.sum(dim=(1, 2))
    assert len(set(areas.tolist())) == 1 and 64 <= areas[0] <= 144  # an 8 to 12 px square, the same in every frame
    ys, xs = torch.meshgrid(torch.arange(32.0), torch.arange(32.0), indexing="ij")
    cx = (is_red * xs).sum(dim=(1, 2)) / areas
    cy = (is_red * ys).sum(dim=(1, 2)) / areas
    assert 8 <= cx[-1] - cx[0] <= 11 and bool((cx[1:] > cx[:-1]).all())
    assert bool((cy == cy[0]).all())


def test_boxes_of_every_motion():
    rng = np.random.default_rng(1)
    for motion, (dx, dy) in {"right": (1, 0), "left": (-1, 0), "up": (0, -1), "down": (0, 1)}.items():
        frames = clip_boxes(_meta(count=3, motion=motion), rng, size=32, num_frames=5)
        for start, end in zip(frames[0], frames[-1]):
            travel = (end[0] - start[0], end[1] - start[1])
            assert travel[0] * dx + travel[1] * dy >= 8 and travel[0] * dy + travel[1] * dx == 0
        assert all(0 <= x and x + s <= 32 and 0 <= y and y + s <= 32 for boxes in frames for x, y, s in boxes)
    grow = clip_boxes(_meta(count=2, motion="growing"), rng, size=32, num_frames=5)
    sides = [boxes[0][2] for boxes in grow]
    assert sides == sorted(sides) and sides[-1] >= sides[0] + 4
    shrink = clip_boxes(_meta(motion="shrinking"), rng, size=32, num_frames=5)
    assert [b[0][2] for b in shrink] == sorted((b[0][2] for b in shrink), reverse=True)


def test_rendering_is_deterministic_and_counts_objects():
    m = _meta("blue", "circle", 3, "growing")
    a = render_clip(m, np.random.default_rng(5), num_frames=9)
    b = render_clip(m, np.random.default_rng(5), num_frames=9)
    assert a.shape == (9, 3, 32, 32) and torch.equal(a, b)
    source = MovingShapesPrompts(MovingShapesPrompts.Config(num_frames=7, image_size=48))
    assert source.render(m, np.random.default_rng(0)).shape == (7, 3, 48, 48)


@pytest.mark.parametrize("options, words", [
    ({"kinds": ["single", "position"]}, "kinds"),
    ({"counts": [4]}, "counts"),
    ({"motions": ["spinning"]}, "motions"),
    ({"motions": []}, "motions"),
    ({"eval_fraction": 0.0}, "eval_fraction"),
    ({"held_out": "rl_only", "eval_fraction": 0.6}, "eval_fraction"),
    ({"num_frames": 1}, "num_frames"),
    ({"image_size": 16}, "image_size"),
    ({"n_train": -1}, "n_train"),
    ({"colour": "red"}, "colour"),
])
def test_bad_config_is_refused_with_the_key(options, words):
    with pytest.raises((ValueError, TypeError), match=words):
        MovingShapesPrompts.Config(**options)


def test_bad_render_arguments():
    with pytest.raises(ValueError, match="num_frames"):
        render_clip(_meta(), np.random.default_rng(0), num_frames=1)
    with pytest.raises(ValueError, match="motion"):
        render_clip(_meta(motion="spinning"), np.random.default_rng(0))
    assert set(MOTIONS) == {"right", "left", "up", "down", "growing", "shrinking"}
