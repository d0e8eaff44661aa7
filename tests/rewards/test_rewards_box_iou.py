"""box_iou: known IoU values, frames, parsing variants, matching, degenerate boxes and malformed answers."""

import itertools
import math

import pytest
import torch

from mmgrpo.rewards._matching import _hungarian_min_cost, max_weight_matching
from mmgrpo.rewards.box_iou import BoxIoU, box_iou, parse_boxes
from mmgrpo.types import PromptBatch


def score(text, boxes, coords="original", **metadata):
    reward = BoxIoU(BoxIoU.Config(coords=coords, **metadata.pop("config", {})))
    result = reward({"texts": [text]}, PromptBatch(["p"], metadata=[{"boxes": boxes, **metadata}]))
    return float(result.scores[0]), {k: float(v[0]) for k, v in result.components.items()}


def test_identical_disjoint_and_partial_overlap():
    assert score("[10, 10, 20, 20]", [10, 10, 20, 20])[0] == 1.0
    assert score("[0, 0, 5, 5]", [10, 10, 20, 20])[0] == 0.0
    assert score("[0, 0, 10, 10]", [10, 10, 20, 20])[0] == 0.0  # touching corners: no area in common
    # [0, 0, 10, 10] vs [5, 5, 15, 15]: intersection 5 * 5 = 25, union 100 + 100 - 25 = 175
    assert score("[0, 0, 10, 10]", [5, 5, 15, 15])[0] == pytest.approx(25 / 175)
    # [0, 0, 20, 10] vs [10, 0, 30, 10]: intersection 100, union 300
    assert score("[0, 0, 20, 10]", [10, 0, 30, 10])[0] == pytest.approx(1 / 3)


def test_resized_frame_maps_back_to_the_original_image():
    sizes = {"image_size": [1000, 500], "input_size": [500, 250]}  # the processor halved the image
    assert score("[50, 50, 100, 100]", [100, 100, 200, 200], coords="resized", **sizes)[0] == 1.0
    # the same numbers read in the wrong frame miss the object: the users' "IoU stuck at 0"
    assert score("[50, 50, 100, 100]", [100, 100, 200, 200], coords="original", **sizes)[0] == 0.0
    # non-uniform resize (Qwen rounds each side to a multiple of 28): 1000 x 500 -> 1008 x 504
    iou, _ = score("[100.8, 100.8, 201.6, 201.6]", [100, 100, 200, 200], coords="resized",
                   image_size=[1000, 500], input_size=[1008, 504])
    assert iou == pytest.approx(1.0)


def test_normalised_coordinates():
    size = {"image_size": [1000, 500]}
    assert score("[100, 200, 200, 400]", [100, 100, 200, 200], coords="norm1000", **size)[0] == pytest.approx(1.0)
    assert score("[0.1, 0.2, 0.2, 0.4]", [100, 100, 200, 200], coords="norm1", **size)[0] == pytest.approx(1.0)


def test_missing_frame_size_is_a_clear_error():
    with pytest.raises(ValueError, match="input_size"):
        score("[1, 1, 2, 2]", [1, 1, 2, 2], coords="resized", image_size=[10, 10])
    with pytest.raises(ValueError, match="image_size"):
        score("[1, 1, 2, 2]", [1, 1, 2, 2], coords="norm1000")


@pytest.mark.parametrize(
    "text",
    [
        "[10, 10, 20, 20]",
        "[10.0, 10.0, 20.0, 20.0]",
        "<answer>[10, 10, 20, 20]</answer>",
        '<think>first [0, 0, 5, 5]</think> <answer>```json\n[{"bbox_2d": [10, 10, 20, 20], "label": "cat"}]\n```</answer>',
        '{"bbox": [10, 10, 20, 20]}',
        "<box>(10,10),(20,20)</box>",
        "<box>[10, 10, 20, 20]</box>",
        "<box>10 10 20 20</box>",
        "<|box_start|>(10,10),(20,20)<|box_end|>",
        "The object is at (10, 10, 20, 20).",
    ],
)
def test_text_variants(text):
    assert parse_boxes(text) == [[10.0, 10.0, 20.0, 20.0]]
    assert score(text, [10, 10, 20, 20])[0] == 1.0


def test_multi_object_matching_is_optimal_and_penalises_extra_and_missing_boxes():
    truth = [[0, 0, 10, 10], [20, 20, 30, 30]]
    assert score("[[20, 20, 30, 30], [0, 0, 10, 10]]", truth)[0] == 1.0  # order does not matter
    assert score("[[0, 0, 10, 10]]", truth)[0] == pytest.approx(1 / 2)  # one of two found
    assert score("[[0, 0, 10, 10], [20, 20, 30, 30], [50, 50, 60, 60]]", truth)[0] == pytest.approx(2 / 3)
    # greedy matching would pair the best single box first (IoU 0.9-ish) and lose the other pair
    weights = torch.tensor([[0.9, 0.8], [0.8, 0.0]])
    assert sorted(max_weight_matching(weights)) == [(0, 1), (1, 0)]


def _brute_force_best(weights):
    rows, cols = weights.shape
    if rows > cols:
        return _brute_force_best(weights.T)
    return max(float(sum(weights[r, c] for r, c in enumerate(perm))) for perm in itertools.permutations(range(cols), rows))


def test_assignment_fallback_is_exact():
    generator = torch.Generator().manual_seed(0)
    for rows, cols in [(3, 3), (4, 6), (6, 4), (1, 5)]:
        weights = torch.rand(rows, cols, generator=generator)
        cost = (-weights.double()).tolist()
        if rows <= cols:
            pairs = _hungarian_min_cost(cost)
        else:
            pairs = [(r, c) for c, r in _hungarian_min_cost([list(col) for col in zip(*cost)])]
        assert len(pairs) == min(rows, cols) == len({r for r, _ in pairs}) == len({c for _, c in pairs})
        assert float(sum(weights[r, c] for r, c in pairs)) == pytest.approx(_brute_force_best(weights))
        assert sorted(max_weight_matching(weights)) == sorted(pairs)


def test_degenerate_inverted_and_out_of_range_boxes():
    assert box_iou(torch.tensor([[5.0, 5, 5, 10]]), torch.tensor([[0.0, 0, 10, 10]])).item() == 0.0  # zero width
    assert box_iou(torch.tensor([[5.0, 5, 5, 5]]), torch.tensor([[5.0, 5, 5, 5]])).item() == 0.0  # zero union
    value, parts = score("[5, 5, 5, 10]", [0, 0, 10, 10])
    assert value == 0.0 and parts["malformed"] == 0.0
    value, parts = score("[20, 20, 10, 10]", [10, 10, 20, 20])  # inverted: not silently reordered
    assert value == 0.0 and parts["malformed"] == 1.0
    value, parts = score("[-10, -10, 20, 20]", [0, 0, 20, 20], image_size=[64, 64])  # clipped to the image
    assert value == 1.0 and parts["clipped"] == 1.0


def test_no_target_malformed_and_not_applicable():
    assert score("nothing there", [])[0] == 1.0  # no target, no box: right
    assert score("[1, 2, 3, 4]", [])[0] == 0.0
    value, parts = score("I cannot see it", [[1, 2, 3, 4]])
    assert value == 0.0 and parts["malformed"] == 1.0
    value, parts = score("[1, 2, 3]", [[1, 2, 3, 4]])  # three numbers are not a box
    assert value == 0.0 and parts["malformed"] == 1.0
    reward = BoxIoU()
    result = reward({"texts": ["[1, 2, 3, 4]", None]}, PromptBatch(["a", "b"], metadata=[{}, {"boxes": [1, 2, 3, 4]}]))
    assert math.isnan(result.scores[0]) and result.scores[1] == 0.0 and result.components["malformed"][1] == 1.0


def test_threshold_mode():
    partial = "[0, 0, 10, 10]"  # IoU 1/7 with the truth below
    assert score(partial, [5, 5, 15, 15], config={"threshold": 0.1})[0] == 1.0
    value, parts = score(partial, [5, 5, 15, 15], config={"threshold": 0.5})
    assert value == 0.0 and parts["iou"] == pytest.approx(1 / 7)


@pytest.mark.parametrize(
    "options, key",
    [
        ({"max_boxes": True}, "max_boxes"),
        ({"coords": "pixels"}, "coords"),
        ({"answer_tag": "<answer>"}, "answer_tag"),
        ({"gt_key": ""}, "gt_key"),
        ({"max_completion_chars": -1}, "max_completion_chars"),
        ({"max_completion_chars": 2.5}, "max_completion_chars"),
    ],
)
def test_config_refuses_unusable_values_naming_the_key(options, key):
    with pytest.raises(ValueError, match=key):
        BoxIoU.Config(**options)


def _box_iou_by_hand(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The pairwise IoU written out (the formula mmgrpo computed before it used torchvision): clamped overlap widths,
    inverted boxes of area 0, 0 for a zero union."""
    out = torch.zeros(len(a), len(b), dtype=torch.float64)
    for i, (ax1, ay1, ax2, ay2) in enumerate(a.double().tolist()):
        for j, (bx1, by1, bx2, by2) in enumerate(b.double().tolist()):
            inter = max(0.0, min(ax2, bx2) - max(ax1, bx1)) * max(0.0, min(ay2, by2) - max(ay1, by1))
            union = max(0.0, ax2 - ax1) * max(0.0, ay2 - ay1) + max(0.0, bx2 - bx1) * max(0.0, by2 - by1) - inter
            out[i, j] = inter / union if union > 0 else 0.0
    return out


def test_box_iou_through_torchvision_gives_the_same_numbers_as_the_formula_written_out():
    generator = torch.Generator().manual_seed(0)
    corners = torch.randint(0, 40, (64, 4), generator=generator).double()  # some inverted, some empty
    exact = torch.tensor([[1.0, 2, 30, 20], [5.0, 5, 5, 5], [30.0, 20, 1, 2], [0.0, 0, 0.5, 40]])
    a, b = torch.cat([corners[:32], exact]), torch.cat([corners[32:], exact])
    assert ((a[:, 2] < a[:, 0]) | (a[:, 3] < a[:, 1])).any() and ((a[:, 2] == a[:, 0]) | (a[:, 3] == a[:, 1])).any()
    torch.testing.assert_close(box_iou(a, b), _box_iou_by_hand(a, b), rtol=0, atol=1e-12)
