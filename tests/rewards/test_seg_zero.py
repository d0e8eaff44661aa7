"""Seg-Zero's five 0/1 terms on hand cases: format, JSON answer, box IoU > 0.5, box L1 < 10 px, points in the box and
near the true points; frames mapped as box_iou; weights."""

import pytest
import torch

from mmgrpo.rewards.seg_zero import TERMS, SegZero, SegZeroConfig
from mmgrpo.types import PromptBatch
from mmgrpo.validation import ConfigError

TRUTH = {"boxes": [20, 10, 60, 40], "image_size": [200, 100]}


def answer(box, p1, p2, think=True):
    body = f'<answer>{{"bbox": {box}, "points_1": {p1}, "points_2": {p2}}}</answer>'
    return ("<think>look</think>" if think else "") + body


def terms(text, metadata=TRUTH, **options):
    result = SegZero(SegZeroConfig(coords=options.pop("coords", "original"), **options))(
        {"texts": [text]}, PromptBatch(["q"], metadata=[dict(metadata)]))
    return result.scores.item(), {k: result.components[k].item() for k in TERMS}


def test_a_perfect_answer_scores_five():
    score, parts = terms(answer([20, 10, 60, 40], [30, 20], [50, 30]))
    assert score == 5 and set(parts.values()) == {1.0}


def test_box_terms_by_hand():
    # [24, 10, 60, 40]: IoU 36 * 30 / (40 * 30) = 0.9 > 0.5; mean |diff| = 4 / 4 = 1 < 10
    _, parts = terms(answer([24, 10, 60, 40], [30, 20], [50, 30]))
    assert parts["box_iou"] == 1 and parts["box_l1"] == 1
    # [40, 10, 80, 40]: IoU 600 / 1800 = 1/3; mean |diff| = (20 + 0 + 20 + 0) / 4 = 10, not below 10; no <think>
    score, parts = terms(answer([40, 10, 80, 40], [45, 20], [50, 30], think=False))
    assert parts == {"think_format": 0, "answer_format": 1, "box_iou": 0, "box_l1": 0, "points": 1} and score == 2


def test_points_inside_the_true_box_and_near_the_true_points():
    with_points = {**TRUTH, "points": [[30, 20], [50, 30]]}
    assert terms(answer([20, 10, 60, 40], [30, 20], [150, 30]), with_points)[1]["points"] == 0  # one outside the box
    assert terms(answer([20, 10, 60, 40], [50, 30], [30, 20]), with_points)[1]["points"] == 1  # paired either way
    # (21, 11) and (59, 39): each sqrt(81 + 81) = 12.7 px from its true point
    near = answer([20, 10, 60, 40], [21, 11], [59, 39])
    assert terms(near, with_points)[1]["points"] == 1
    assert terms(near, with_points, point_threshold=12.0)[1]["points"] == 0
    assert terms(near, with_points, point_threshold=13.0)[1]["points"] == 1


def test_resized_frame_and_weights():
    resized = {**TRUTH, "input_size": [100, 50]}  # the model saw half the size: (10, 5, 30, 20) is the true box
    score, parts = terms(answer([10, 5, 30, 20], [15, 10], [25, 15]), resized, coords="resized")
    assert score == 5
    score, _ = terms(answer([20, 10, 60, 40], [30, 20], [50, 30]), weights={"think_format": 0.0, "box_iou": 2.0})
    assert score == 0 + 1 + 2 + 1 + 1


@pytest.mark.parametrize("text, expected", [
    ("junk", {"think_format": 0}),
    ("<think>a</think><answer>not json</answer>", {"think_format": 1}),
    ("<think>a</think><answer>" + '{"bbox": [20, 10, 60, 40]}' + "</answer>", {"think_format": 1, "box_iou": 1,
                                                                             "box_l1": 1}),  # no points
])
def test_malformed_answers_score_their_defined_terms(text, expected):
    score, parts = terms(text)
    assert parts == {**dict.fromkeys(TERMS, 0.0), **expected} and score == sum(expected.values())


def test_not_applicable_without_a_true_box_and_config_errors():
    result = SegZero()({"texts": ["x"]}, PromptBatch(["q"]))
    assert torch.isnan(result.scores).all()
    with pytest.raises(ConfigError, match="unknown terms"):
        SegZeroConfig(weights={"mask": 1.0})
    with pytest.raises(ConfigError, match="l1_threshold"):
        SegZeroConfig(l1_threshold=0)


def test_the_seg_r1_config_layout_accepts_its_answers_and_finishes_on_adversarial_text():
    from pathlib import Path

    from mmgrpo.config_yaml import read_yaml
    from mmgrpo.rewards.format import FormatReward
    from test_rewards_adversarial import LIMIT_S, deadline

    config = Path(__file__).resolve().parents[2] / "configs" / "qwen2_5_vl_7b_seg_r1.yaml"
    options = {k: v for k, v in read_yaml(config)["reward"]["rewards"]["format"].items() if k != "weight"}
    reward = FormatReward(FormatReward.Config(**options))
    good = ("<think>a</think> <bbox>[1,2,3,4]</bbox>, <bbox>[5,6,7,8]</bbox> <points>[[2,3]]</points>, "
            "<labels>[1]</labels>")
    bad = ["<think>a</think><points>[[2,3]]</points><labels>[1]</labels>", good + "<labels>[1]</labels>", "junk"]
    batch = PromptBatch(["q"] * 4)
    assert reward({"texts": [good, *bad]}, batch).scores.tolist() == [1, 0, 0, 0]
    adversarial = "<think>a</think>" + "<bbox></bbox>," * 1300 + "<points></points><labels>"
    with deadline(LIMIT_S):
        assert reward({"texts": [adversarial]}, PromptBatch(["q"])).scores.tolist() == [0]
