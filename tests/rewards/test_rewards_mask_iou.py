"""mask_iou: known IoU and S-measure values, frame mapping, empty masks and malformed predictions."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mmgrpo.rewards.mask_iou import MaskIoU, s_measure
from mmgrpo.types import PromptBatch


def square(size, top, left, side):
    mask = torch.zeros(size, size, dtype=torch.bool)
    mask[top : top + side, left : left + side] = True
    return mask


def run(predictions, truths, **options):
    reward = MaskIoU(MaskIoU.Config(**options))
    metadata = [{} if truth is None else {"mask": truth} for truth in truths]
    return reward({"masks": predictions}, PromptBatch(["p"] * len(truths), metadata=metadata))


def test_known_iou_values():
    gt = square(16, 2, 2, 8)  # 64 pixels
    shifted = square(16, 6, 2, 8)  # overlaps 4 rows x 8 = 32; union 96
    result = run(torch.stack([gt, square(16, 12, 12, 4), shifted]), [gt, gt, gt])
    assert result.scores.tolist() == pytest.approx([1.0, 0.0, 1 / 3])
    assert result.components["s_measure"][0] == pytest.approx(1.0)  # identical masks are structurally identical
    assert result.components["malformed"].tolist() == [0.0, 0.0, 0.0]


def test_s_measure_known_values_and_weighting():
    empty = torch.zeros(8, 8)
    assert s_measure(empty, empty.bool()) == 1.0  # no object, nothing predicted
    assert s_measure(torch.ones(8, 8), empty.bool()) == 0.0  # no object, everything predicted
    assert s_measure(torch.ones(8, 8), torch.ones(8, 8).bool()) == 1.0
    gt = square(16, 2, 2, 8)
    pred = square(16, 6, 2, 8)
    result = run(pred[None].float(), [gt], s_measure_weight=0.3)
    iou, structure = result.components["iou"][0], result.components["s_measure"][0]
    assert 0 < structure < 1 and result.scores[0] == pytest.approx(0.7 * iou + 0.3 * structure)


def test_prediction_in_a_resized_frame_and_soft_masks():
    gt = square(16, 4, 4, 8)
    small = square(8, 2, 2, 4)  # the same square at half resolution
    assert run([small], [gt]).scores[0] == 1.0
    soft = gt.float() * 0.9 + 0.05  # probabilities, thresholded at 0.5
    assert run(soft[None], [gt]).scores[0] == 1.0
    assert run(soft[None], [gt], threshold=0.95).scores[0] == 0.0


def test_empty_truth_malformed_predictions_and_not_applicable():
    empty = torch.zeros(8, 8, dtype=torch.bool)
    assert run(empty[None], [empty]).scores[0] == 1.0  # no target, nothing predicted
    gt = square(8, 0, 0, 4)
    nan_mask = torch.full((8, 8), float("nan"))
    result = run([None, nan_mask, torch.ones(2, 8, 8), gt], [gt, gt, gt, None])
    assert result.scores[:3].tolist() == [0.0, 0.0, 0.0]
    assert result.components["malformed"][:3].tolist() == [1.0, 1.0, 1.0]
    assert math.isnan(result.scores[3])  # no ground truth: not applicable


WRONG_TYPES = ["abc", ["a", "b"], [["a", "b"], ["c", "d"]], {"mask": 1}, b"\x00\x01", [[1, 0], [0]],
               torch.zeros(4, 4, dtype=torch.complex64), 3, 2.5, True]


@pytest.mark.parametrize("reward_name", ["mask_iou", "s_measure"])
@pytest.mark.parametrize("wrong", WRONG_TYPES, ids=lambda v: type(v).__name__)
def test_a_mask_of_the_wrong_type_scores_zero_and_counts_as_malformed(reward_name, wrong):
    from mmgrpo import registry

    reward = registry.get("reward", reward_name)()
    gt = square(8, 0, 0, 4)
    result = reward({"masks": [wrong, gt]}, PromptBatch(["p", "q"], metadata=[{"mask": gt}, {"mask": gt}]))
    assert result.scores.tolist()[0] == 0.0 and result.components["malformed"].tolist() == [1.0, 0.0]
    assert result.scores[1] > 0.9  # the well-formed mask beside it is still scored


@settings(max_examples=60, deadline=None, derandomize=True)
@given(value=st.recursive(st.one_of(st.none(), st.booleans(), st.integers(-3, 3), st.floats(), st.text(max_size=3),
                                    st.binary(max_size=3)),
                          lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=2), inner,
                                                                                     max_size=2), max_leaves=10))
def test_any_value_as_a_mask_gives_a_finite_score_or_malformed(value):
    gt = square(4, 0, 0, 2)
    result = run([value], [gt])
    assert math.isfinite(result.scores[0]) and 0 <= result.scores[0] <= 1
    assert result.components["malformed"][0] in (0.0, 1.0)


@pytest.mark.parametrize(
    "options, key",
    [
        ({"threshold": "0.5x"}, "threshold"),
        ({"s_measure_weight": True}, "s_measure_weight"),
        ({"gt_key": ""}, "gt_key"),
        ({"gt_key": 3}, "gt_key"),
    ],
)
def test_config_refuses_unusable_values_naming_the_key(options, key):
    with pytest.raises(ValueError, match=key):
        MaskIoU.Config(**options)
