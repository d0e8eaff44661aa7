"""The synthetic referring-segmentation task: each mask is exactly the target shape's pixels in the image, each
question names one shape (the largest one by the margin), items are deterministic and the splits disjoint."""

import numpy as np
import pytest
import torch

from mmgrpo.data.referring_jsonl import TEMPLATES
from mmgrpo.data.seg_shapes import QUADRANTS, SegShapes, SegShapesConfig, target_quadrant, target_text
from mmgrpo.data.vlm_shapes import COLOURS


@pytest.fixture(scope="module")
def items():
    return SegShapes(SegShapesConfig(n_train=120, n_eval=20, prompt_template="seg_r1")).train_items()


def test_masks_are_the_pixels_of_the_named_shape(items):
    for item in items:
        metadata = item["metadata"]
        pixels = np.asarray(item["images"][0])  # [H, W, 3]
        x1, y1, x2, y2 = (int(v) for v in metadata["boxes"])
        colour = next(c for c in COLOURS if c in metadata["question"]) if metadata["task"] != "shape" else None
        inside = torch.from_numpy(pixels[y1:y2, x1:x2].any(axis=-1))  # lit pixels in the box: the target's only
        assert torch.equal(metadata["mask"][y1:y2, x1:x2], inside) and metadata["mask"].sum() == inside.sum()
        if colour:
            assert (pixels[metadata["mask"].numpy()] == COLOURS[colour]).all()
        assert item["prompt"] == TEMPLATES["seg_r1"].format(question=metadata["question"])


def _quadrant_counts(pixels: np.ndarray, colour) -> list[int]:
    """Pixels of `colour` in each quadrant (every shape lies inside one quadrant)."""
    same, half = (pixels == colour).all(axis=-1), pixels.shape[0] // 2
    return [int(same[r : r + half, c : c + half].sum()) for r in (0, half) for c in (0, half)]


def test_each_question_names_exactly_one_shape(items):
    kinds = set()
    for item in items:
        metadata = item["metadata"]
        kinds.add(metadata["task"])
        pixels, area = np.asarray(item["images"][0]), int(metadata["mask"].sum())
        if metadata["task"] == "largest":  # "the largest blue shape": it beats each other blue shape by the margin
            counts = _quadrant_counts(pixels, COLOURS[metadata["question"].split()[2]])
            rivals = [n for n in counts if n and n != area]
            assert rivals and area in counts and all(area >= n + SegShapesConfig().min_margin for n in rivals)
        elif metadata["task"] == "colour_shape":  # "the red triangle": its colour's pixels in its quadrant are its own
            assert area in _quadrant_counts(pixels, COLOURS[metadata["question"].split()[1]])
    assert kinds == {"colour_shape", "shape", "largest"}


def test_items_are_deterministic_and_splits_disjoint():
    source = SegShapes(SegShapesConfig(n_train=30, n_eval=30))
    first, again = source.train_items(), source.train_items()
    assert all(torch.equal(a["metadata"]["mask"], b["metadata"]["mask"]) and a["prompt"] == b["prompt"]
               for a, b in zip(first, again))
    train = {(i["prompt"], np.asarray(i["images"][0]).tobytes()) for i in first}
    held_out = {(i["prompt"], np.asarray(i["images"][0]).tobytes()) for i in source.eval_items()}
    assert not train & held_out


def test_bad_options_are_refused():
    with pytest.raises(ValueError, match="questions"):
        SegShapesConfig(questions=["biggest"])
    with pytest.raises(ValueError, match="size"):
        SegShapesConfig(size=8)
    with pytest.raises(ValueError, match="data.thought must be one of"):
        SegShapesConfig(thought="grid")


def test_target_text_by_hand():
    shapes = [{"shape": "circle", "colour": "red", "cell": 1}, {"shape": "square", "colour": "blue", "cell": 2}]
    mask = torch.zeros(56, 56, dtype=torch.bool)
    mask[8:20, 32:44] = True  # a 12 x 12 square in the top right quadrant
    metadata = {"boxes": [32.0, 8.0, 43.0, 19.0], "image_size": [56, 56], "mask": mask}
    # interior pixels span rows 9..18 and columns 33..42; centroid (37.5, 13.5); targets 11.67 and 15.33 rows
    answer = '<answer>{"bbox": [32, 8, 43, 19], "points_1": [37, 12], "points_2": [37, 15]}</answer>'
    assert target_text(metadata, shapes) == (
        "<think>top left none, top right red circle, bottom left blue square, bottom right none: top right</think>"
        + answer)
    assert target_text(metadata, shapes, "list") == (
        "<think>none, red circle, blue square, none: top right</think>" + answer)
    assert target_text(metadata, shapes, "match") == (
        "<think>top left none no, top right red circle yes</think>" + answer)
    assert target_quadrant(metadata) == 1


def test_target_quadrant_is_the_quadrant_the_thought_names():
    items = SegShapes(SegShapesConfig(n_train=40, n_eval=0, with_targets=True)).train_items()
    named = [item["metadata"]["completion"].split("</think>")[0].rsplit(": ", 1)[1] for item in items]
    assert [QUADRANTS[target_quadrant(item["metadata"])] for item in items] == named
    assert len(set(named)) == 4  # every quadrant occurs


def test_with_targets_writes_the_completion_of_the_scene():
    plain = SegShapes(SegShapesConfig(n_train=5, n_eval=0)).train_items()
    targets = SegShapes(SegShapesConfig(n_train=5, n_eval=0, with_targets=True)).train_items()
    assert all("completion" not in item["metadata"] for item in plain)
    for item in targets:
        text = item["metadata"]["completion"]
        assert text.startswith("<think>top left ") and text.endswith("}</answer>")
        assert item["metadata"]["question"].removeprefix("the ").removeprefix("largest ").split()[0] in text
