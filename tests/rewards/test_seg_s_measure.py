"""The S-measure reward against a hand computation of Fan et al.'s object and region terms (alpha = 0.5)."""

import math

import pytest
import torch

from mmgrpo.rewards.s_measure import SMeasure, SMeasureConfig
from mmgrpo.types import PromptBatch


def _score(pred, truth, **options):
    batch = PromptBatch(["x"], metadata=[{"mask": torch.tensor(truth)}])
    return SMeasure(SMeasureConfig(**options))({"masks": [torch.tensor(pred, dtype=torch.float32)]}, batch)


def test_s_measure_by_hand():
    truth = [[1, 1, 1, 0, 0, 0]]
    pred = [[1, 0, 1, 1, 0, 0]]
    # object term: on the object the prediction is (1, 0, 1): mean 2/3, std sqrt((1/9 + 4/9 + 1/9) / 2) = sqrt(1/3);
    # on the background 1 - prediction is (0, 1, 1): the same mean and std; mu = 1/2
    o = 2 * (2 / 3) / ((2 / 3) ** 2 + 1 + math.sqrt(1 / 3))
    s_object = 0.5 * o + 0.5 * o
    # region term: centroid column round(1) + 1 = 2, row round(0) + 1 = 1 -> blocks: columns 0-1 (2 px), 2-5 (4 px)
    # block 1: P (1, 0), T (1, 1): var(T) = 0 and cov = 0 -> numerator 0, denominator (1/4 + 1) * 1/2 != 0 -> 0
    # block 2: P (1, 1, 0, 0), T (1, 0, 0, 0): means 1/2, 1/4; var 1/3, 1/4; cov ((1/2)(3/4) + (1/2)(-1/4)
    #          + (-1/2)(-1/4) * 2) / 3 = 1/6
    ssim2 = 4 * 0.5 * 0.25 * (1 / 6) / ((0.25 + 0.0625) * (1 / 3 + 0.25))
    s_region = 2 / 6 * 0 + 4 / 6 * ssim2
    expected = 0.5 * s_object + 0.5 * s_region
    assert expected == pytest.approx(0.48212, abs=1e-4)  # the numbers written out above
    result = _score(pred, truth)
    assert result.scores.item() == pytest.approx(expected, abs=1e-6)
    assert _score(pred, truth, alpha=1.0).scores.item() == pytest.approx(s_object, abs=1e-6)


def test_limits_and_malformed_predictions():
    assert _score([[1.0, 0.0], [0.0, 1.0]], [[1, 0], [0, 1]]).scores.item() == pytest.approx(1.0, abs=1e-6)
    assert _score([[0.25, 0.25]], [[0, 0]]).scores.item() == pytest.approx(0.75)  # no object: 1 - mean(P)
    assert _score([[0.25, 0.75]], [[1, 1]]).scores.item() == pytest.approx(0.5)  # all object: mean(P)
    batch = PromptBatch(["x", "y"], metadata=[{"mask": torch.ones(2, 2)}, {}])
    result = SMeasure()({"masks": [None, torch.ones(2, 2)]}, batch)
    assert result.scores[0] == 0 and result.components["malformed"][0] == 1 and torch.isnan(result.scores[1])
