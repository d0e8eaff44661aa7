"""TempSamp-R1's soft advantage (``advantage_transform: tempsamp_soft``): the reward transform against scalar values
worked out by hand, the advantages of every token algorithm built on the transformed rewards, and its options'
checks."""

import math
import statistics

import pytest
import torch
from hypothesis import given, settings, strategies as st

from mmgrpo import registry
from mmgrpo.advantages import tempsamp_soft
from mmgrpo.validation import ConfigError
from algorithm_options import algo_config

TOKEN_ALGORITHMS = ["grpo", "dr_grpo", "dapo", "gspo", "sapo", "reg_grpo"]


def soft(r, tau=0.8, a_high=0.01, a_low=1.0):
    """The paper's two branches, written with scalar math."""
    if r >= tau:
        return tau + a_high * math.log(r - tau + 1)
    return tau - (math.exp(a_low * (tau - r)) - 1) / (math.exp(a_low) - 1)


def test_transform_matches_hand_values():
    # tau 0.8: 1.0 -> 0.8 + 0.01 ln 1.2; 0.5 -> 0.8 - (e^0.3 - 1) / (e - 1); 0 -> 0.8 - (e^0.8 - 1) / (e - 1)
    scores = torch.tensor([1.0, 0.8, 0.5, 0.0, -0.2, float("nan")])
    out = tempsamp_soft(scores)
    expected = [0.8018232, 0.8, 0.5963899, 0.0867643, -0.2, float("nan")]
    torch.testing.assert_close(out, torch.tensor(expected), rtol=0, atol=1e-6, equal_nan=True)
    other = tempsamp_soft(torch.tensor([0.9, 0.3]), threshold=0.6, alpha_high=0.5, alpha_low=2.0)
    torch.testing.assert_close(other, torch.tensor([soft(0.9, 0.6, 0.5, 2.0), soft(0.3, 0.6, 0.5, 2.0)]))


@settings(max_examples=200, deadline=None)
@given(st.floats(-3, 3), st.floats(-3, 3), st.floats(-1, 2), st.floats(0, 1), st.floats(0.05, 5))
def test_transform_is_increasing_and_continuous(a, b, tau, a_high, a_low):
    low, high = sorted((a, b))
    out = tempsamp_soft(torch.tensor([low, high], dtype=torch.float64), tau, a_high, a_low)
    assert out[0] <= out[1] + 1e-6
    at = tempsamp_soft(torch.tensor([tau - 1e-6, tau], dtype=torch.float64), tau, a_high, a_low)
    assert abs(float(at[0] - at[1])) < 1e-4  # the branches meet at tau


@pytest.mark.parametrize("name", TOKEN_ALGORITHMS)
def test_every_token_algorithm_normalises_the_transformed_rewards(name):
    cls = registry.get("algorithm", name)
    scores = torch.tensor([1.0, 0.5, 0.0, 0.9, 0.3, 0.3])
    groups = torch.tensor([0, 0, 0, 0, 1, 1])
    shaped = [soft(r) for r in scores.tolist()[:4]]
    mean = statistics.fmean(shaped)
    plain = cls(cls.Config()).advantages(scores, groups)
    algorithm = cls(algo_config(cls.Config, advantage_transform="tempsamp_soft"))
    adv = algorithm.advantages(scores, groups)
    if name == "dr_grpo":  # mean-centred only
        expected = [s - mean for s in shaped]
    else:  # every other token algorithm: the unbiased group std (n - 1) + 1e-4, by default
        expected = [(s - mean) / (statistics.stdev(shaped) + 1e-4) for s in shaped]
    torch.testing.assert_close(adv[:4], torch.tensor(expected), rtol=0, atol=1e-5)
    assert adv[4] == adv[5] == 0  # equal rewards stay exactly 0
    assert not torch.allclose(adv, plain)  # the option changes the advantages


def test_rewards_above_the_threshold_count_nearly_alike():
    """0.85 and 1.0 are both a success: after the transform their advantages nearly coincide, while the plain ones
    keep them apart; below the threshold the order is kept."""
    algorithm = registry.get("algorithm", "grpo")
    scores = torch.tensor([1.0, 0.85, 0.4, 0.1])
    groups = torch.zeros(4, dtype=torch.long)
    soft_adv = algorithm(algo_config(algorithm.Config, advantage_transform="tempsamp_soft")).advantages(scores, groups)
    plain = algorithm(algorithm.Config()).advantages(scores, groups)
    assert soft_adv[0] - soft_adv[1] < 0.05 < plain[0] - plain[1]
    assert soft_adv[1] > soft_adv[2] > soft_adv[3]


@pytest.mark.parametrize(("options", "message"), [
    ({"advantage_transform": "soft"}, "advantage_transform"),
    ({"advantage_transform": "tempsamp_soft", "soft_alpha_low": 0.0}, "soft_alpha_low must be > 0"),
    ({"soft_alpha_high": -0.1}, "soft_alpha_high must be >= 0"),
    ({"soft_threshold": float("nan")}, "soft_threshold"),
])
@pytest.mark.parametrize("name", TOKEN_ALGORITHMS)
def test_bad_options_are_refused_naming_the_key(name, options, message):
    cls = registry.get("algorithm", name)
    with pytest.raises((ConfigError, ValueError), match=message):
        algo_config(cls.Config, **options)
