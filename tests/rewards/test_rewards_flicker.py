"""temporal_flicker (VBench's temporal-flickering rule) against 8-bit frame differences written out with numpy."""

import math

import numpy as np
import pytest
import torch

from mmgrpo.config import ConfigError
from mmgrpo.rewards.temporal_flicker import TemporalFlicker
from mmgrpo.types import PromptBatch
from reward_fixtures import clip_of, random_levels

PROMPTS = ["a red circle moving right", "a green triangle growing"]


def test_flicker_on_a_small_clip_by_hand():
    # one sample, three 1x1 frames, every channel at 0, 51, 51: |0 - 51| = 51 and |51 - 51| = 0, mean 25.5
    levels = np.array([0, 51, 51], dtype=np.uint8).reshape(1, 3, 1, 1, 1).repeat(3, axis=-1)
    result = TemporalFlicker()({"videos": clip_of(levels)}, PromptBatch(["p"]))
    assert result.scores.tolist() == pytest.approx([(255 - 25.5) / 255])  # = 0.9
    assert result.components["mean_abs_diff"].tolist() == pytest.approx([25.5])


@pytest.mark.parametrize("stride", [1, 2])
def test_flicker_equals_the_numpy_transcription(stride):
    levels = random_levels()
    reward = TemporalFlicker(TemporalFlicker.Config(frame_stride=stride))
    result = reward({"videos": clip_of(levels)}, PromptBatch(PROMPTS))
    expected = []
    for video in levels.astype(np.int64):  # [F, H, W, 3]
        kept = video[::stride]
        pair_means = [np.abs(kept[i] - kept[i + 1]).mean() for i in range(len(kept) - 1)]  # VBench: absdiff per pair
        expected.append((255.0 - np.mean(pair_means)) / 255.0)
    assert result.scores.tolist() == pytest.approx(expected, abs=1e-6)
    assert 0 < min(expected) < max(expected) < 1  # something to compare


def test_flicker_extremes_and_a_single_frame():
    still = np.full((1, 4, 8, 8, 3), 77, dtype=np.uint8)
    strobe = np.zeros((1, 4, 8, 8, 3), dtype=np.uint8)
    strobe[:, 1::2] = 255  # every pixel jumps 0 <-> 255
    reward = TemporalFlicker()
    both = clip_of(np.concatenate([still, strobe]))
    assert reward({"videos": both}, PromptBatch(PROMPTS)).scores.tolist() == [1.0, 0.0]
    assert math.isnan(reward({"videos": clip_of(still[:, :1])}, PromptBatch(["p"])).scores[0])  # no pair to compare
    # a stride that keeps one frame of the strobe compares nothing either
    strided = TemporalFlicker(TemporalFlicker.Config(frame_stride=4))
    assert math.isnan(strided({"videos": clip_of(strobe)}, PromptBatch(["p"])).scores[0])


def test_flicker_quantises_to_8_bits_and_counts_non_finite_pixels():
    video = torch.zeros(1, 2, 3, 4, 4)
    video[:, 1] = 0.4 / 255  # rounds to level 0: no difference
    assert TemporalFlicker()({"videos": video}, PromptBatch(["p"])).scores.tolist() == [1.0]
    video[0, 1, 0, 0, 0] = float("nan")
    result = TemporalFlicker()({"videos": video}, PromptBatch(["p"]))
    assert result.scores.tolist() == [1.0] and result.components["malformed"].tolist() == [1.0]


def test_flicker_config_and_wiring_errors():
    with pytest.raises(ConfigError, match=r"temporal_flicker\.frame_stride must be >= 1"):
        TemporalFlicker.Config(frame_stride=0)
    with pytest.raises(ValueError, match=r"outputs\['videos'\]"):
        TemporalFlicker()({"images": torch.zeros(2, 3, 8, 8)}, PromptBatch(PROMPTS))
