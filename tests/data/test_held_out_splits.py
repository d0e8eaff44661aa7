"""Out-of-distribution held-out splits of the synthetic sources (`vlm_shapes`, `seg_shapes`, `temporal_shapes` with
``ood: true``): each split's rule is read back from the items' pixels, no training or ``eval`` item satisfies it and
every ``ood`` item does; the items are fixed by the seed; without ``ood`` nothing changes. The unseen-combination
rule is the one `shapes_edit` holds out."""

import itertools

import numpy as np
import pytest

from mmgrpo.data._held_out import held_out_combinations, items_by_rule
from mmgrpo.data.seg_shapes import HELD_OUT as SEG_HELD_OUT, QUESTIONS, SegShapes, SegShapesConfig
from mmgrpo.data.shapes_edit import HELD_OUT as EDIT_HELD_OUT, KINDS
from mmgrpo.data.temporal_shapes import TemporalShapes, TemporalShapesConfig
from mmgrpo.data.vlm_shapes import COLOURS, SHAPES, VLMShapes, VLMShapesConfig

TEMPORAL = dict(num_frames=8, fps=2.0, distractors=1, speed=6, event="visible")  # configs/tiny/temporal_shapes.yaml


def test_unseen_combinations_hold_out_one_colour_per_kind_and_shape_and_leave_every_value_in_training():
    rule = {(k, s, c) for i, k in enumerate(KINDS) for j, s in enumerate(SHAPES) for n, c in enumerate(COLOURS)
            if (i + j + n) % 4 == 0}  # written out: positions summing to a multiple of 4
    assert held_out_combinations(KINDS, SHAPES, tuple(COLOURS)) == EDIT_HELD_OUT == rule
    assert SEG_HELD_OUT == held_out_combinations(QUESTIONS, SHAPES, tuple(COLOURS)) and len(SEG_HELD_OUT) == 9
    everything = set(itertools.product(QUESTIONS, SHAPES, COLOURS))
    for kind, shape in itertools.product(QUESTIONS, SHAPES):
        assert sum((kind, shape, c) in SEG_HELD_OUT for c in COLOURS) == 1
    trained = everything - SEG_HELD_OUT
    for position, values in enumerate((QUESTIONS, SHAPES, tuple(COLOURS))):
        assert {combo[position] for combo in trained} == set(values)


def test_items_by_rule_skips_and_refuses_a_rule_that_admits_nothing():
    assert items_by_rule(lambda i: {"i": i} if i % 3 == 0 else None, 1, 3) == [{"i": 3}, {"i": 6}, {"i": 9}]
    with pytest.raises(ValueError, match="admits almost no item"):
        items_by_rule(lambda i: None, 0, 1)


def _shapes_in(image) -> int:
    """Quadrants with a lit pixel (one shape per quadrant at most)."""
    pixels, half = np.asarray(image).any(axis=-1), image.size[0] // 2
    return sum(bool(pixels[r : r + half, c : c + half].any()) for r in (0, half) for c in (0, half))


def test_vlm_shapes_ood_scenes_have_more_shapes_than_any_training_scene():
    config = dict(max_objects=3, n_train=300, n_eval=60, tasks=["count", "color"], with_targets=True)
    source = VLMShapes(VLMShapesConfig(**config, ood=True))
    splits = source.eval_splits()
    assert list(splits) == ["eval", "ood"] and len(splits["ood"]) == 60
    assert max(_shapes_in(i["images"][0]) for i in source.train_items() + splits["eval"]) == 3
    assert all(_shapes_in(i["images"][0]) == 4 for i in splits["ood"])
    counts = [int(i["metadata"]["answer"]) for i in splits["ood"] if i["metadata"]["task"] == "count"]
    assert 4 in counts  # a count no training question has
    plain = VLMShapes(VLMShapesConfig(**config))
    assert list(plain.eval_splits()) == ["eval"]
    assert [i["prompt"] for i in plain.train_items()] == [i["prompt"] for i in source.train_items()]
    with pytest.raises(ValueError, match="max_objects below 4"):
        VLMShapesConfig(ood=True)


def _fill_shape(mask) -> str:
    """The shape of a mask by how much of its bounding box it fills (square 1, circle pi/4, triangle 1/2)."""
    ys, xs = np.nonzero(np.asarray(mask))
    fill = len(xs) / ((xs.max() - xs.min() + 1) * (ys.max() - ys.min() + 1))
    return "square" if fill > 0.92 else "circle" if fill > 0.64 else "triangle"


def _combination(item) -> tuple[str, str, str]:
    """(question kind, target shape, target colour), the last two read from the image's pixels under the mask."""
    metadata, pixels = item["metadata"], np.asarray(item["images"][0])
    under = pixels[metadata["mask"].numpy()]  # [m, 3] the target's pixels
    colour = next(name for name, rgb in COLOURS.items() if (under == rgb).all())
    return metadata["task"], _fill_shape(metadata["mask"]), colour


def test_seg_shapes_ood_asks_only_held_out_combinations_and_training_never_does():
    source = SegShapes(SegShapesConfig(n_train=200, n_eval=60, ood=True))
    splits = source.eval_splits()
    assert list(splits) == ["eval", "ood"] and len(splits["ood"]) == 60
    for item in source.train_items() + splits["eval"]:
        assert _combination(item) not in SEG_HELD_OUT
        assert tuple(item["metadata"]["combination"]) == _combination(item)
    ood = [_combination(item) for item in splits["ood"]]
    assert all(combo in SEG_HELD_OUT for combo in ood)
    assert {kind for kind, _, _ in ood} == set(QUESTIONS)
    plain = SegShapes(SegShapesConfig(n_train=200, n_eval=60))
    assert list(plain.eval_splits()) == ["eval"]
    assert any(_combination(item) in SEG_HELD_OUT for item in plain.train_items())  # held out only with ood


def _lane_spans(item, lanes: int) -> list[tuple[int, int]]:
    """Each lane's span in frames, ``(first lit frame, last lit frame + 1)``, read from the clip's pixels."""
    frames = [np.asarray(frame).any(axis=-1) for frame in item["video"]]  # [H, W] each
    height = frames[0].shape[0] // lanes
    spans = []
    for lane in range(lanes):
        lit = [f for f, pixels in enumerate(frames) if pixels[lane * height : (lane + 1) * height].any()]
        spans.append((lit[0], lit[-1] + 1))
    return spans


def test_temporal_shapes_ood_targets_spans_at_positions_no_training_clip_has():
    source = TemporalShapes(TemporalShapesConfig(**TEMPORAL, n_train=200, n_eval=40, ood=True))
    splits = source.eval_splits()
    assert list(splits) == ["eval", "ood"] and len(splits["ood"]) == 40
    last_end = 8 - 2  # the last frame a span ends on (frame steps of 2)
    interior = lambda span: span[0] > 0 and span[1] < last_end  # noqa: E731
    for item in source.train_items() + splits["eval"]:
        assert not any(interior(span) for span in _lane_spans(item, 2))
    for item in splits["ood"]:
        start, end = (round(t * 2.0) for t in item["metadata"]["span"])
        assert interior((start, end)) and item["metadata"]["span"] == [1.0, 2.0]
        assert sorted(interior(span) for span in _lane_spans(item, 2)) == [False, True]  # the target's alone
    with pytest.raises(ValueError, match="num_frames >= 4"):
        TemporalShapesConfig(**{**TEMPORAL, "num_frames": 6, "speed": 3}, ood=True)


@pytest.mark.parametrize("build", [
    lambda seed: VLMShapes(VLMShapesConfig(max_objects=3, n_train=5, n_eval=12, seed=seed, ood=True)),
    lambda seed: SegShapes(SegShapesConfig(n_train=5, n_eval=12, seed=seed, ood=True)),
    lambda seed: TemporalShapes(TemporalShapesConfig(**TEMPORAL, n_train=5, n_eval=12, seed=seed, ood=True)),
], ids=["vlm_shapes", "seg_shapes", "temporal_shapes"])
def test_ood_items_are_fixed_by_the_seed(build):
    def key(items):
        return [(i["prompt"], [np.asarray(x).tobytes() for x in i.get("images", i.get("video"))]) for i in items]

    first, again, other = build(0).eval_splits()["ood"], build(0).eval_splits()["ood"], build(1).eval_splits()["ood"]
    assert key(first) == key(again) and key(first) != key(other)
