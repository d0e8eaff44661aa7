"""GDPO's loss and advantages against hand-computed values."""

import math

import pytest
import torch

from mmgrpo.algorithms.gdpo import GDPO, GDPOConfig
from mmgrpo.types import Score
from algorithm_options import algo_config


def _score(elbo, lengths, max_length=4):
    """A score of one draw per sample: ELBO `[n, 1]` and `lengths` scored tokens of `max_length`."""
    tokens = torch.arange(max_length)[None, None, :] < torch.tensor(lengths)[:, None, None]  # [n, 1, L]
    return Score(log_prob=torch.as_tensor(elbo).reshape(-1, 1), mask=torch.ones(len(lengths), 1, dtype=torch.bool),
                 token_mask=tokens)


def test_clipped_sequence_ratio_by_hand():
    """ELBOs -2.0 / -3.0 now, -2.4 / -2.7 at sampling, 2 and 3 scored tokens, advantages +1 / -1, clip 0.2:
    s_1 = exp(0.4 / 2) = 1.2214 is clipped to 1.2 (A > 0: min picks the clip, no gradient);
    s_2 = exp(-0.3 / 3) = 0.9048 lies inside [0.8, 1.2]: loss term -A s_2 = 0.9048. Loss (-1.2 + 0.9048) / 2."""
    elbo = torch.tensor([-2.0, -3.0], requires_grad=True)
    new = _score(elbo, [2, 3])
    old = torch.tensor([[-2.4], [-2.7]])
    algorithm = GDPO(algo_config(GDPOConfig, clip_low=0.2))
    out = algorithm.loss(new, old, torch.tensor([1.0, -1.0]))
    s1, s2 = math.exp(0.2), math.exp(-0.1)
    assert out.loss.item() == pytest.approx((-1.2 + s2) / 2, abs=1e-6)
    assert out.metrics["ratio_mean"] == pytest.approx((s1 + s2) / 2, abs=1e-6)
    assert out.metrics["clip_frac"] == pytest.approx(0.5)
    out.loss.backward()
    # d/dE_2 of (-A_2 s_2) / 2 with s_2 = exp((E_2 - old_2) / 3): (1 * s_2 / 3) / 2; sample 1 is clipped: 0
    torch.testing.assert_close(elbo.grad, torch.tensor([0.0, s2 / 6]))


def test_unnormalised_ratio_and_kl_by_hand():
    """length_normalize=False: s = exp(E - E_old); the KL term is k3 on the raw ELBOs, d = E_ref - E."""
    new, old = _score([-2.0, -3.0], [2, 3]), torch.tensor([[-2.1], [-3.0]])
    ref = _score([-2.5, -2.0], [2, 3])
    algorithm = GDPO(algo_config(GDPOConfig, clip_low=0.5, length_normalize=False, kl_beta=0.1))
    out = algorithm.loss(new, old, torch.tensor([2.0, 1.0]), ref)
    s1 = math.exp(0.1)
    kl = ((math.exp(-0.5) + 0.5 - 1) + (math.exp(1.0) - 1.0 - 1)) / 2
    assert float(out.loss) == pytest.approx((-2 * s1 - 1.0) / 2 + 0.1 * kl, abs=1e-6)
    assert out.metrics["kl"] == pytest.approx(kl, abs=1e-6)
    normalised = GDPO(algo_config(GDPOConfig, clip_low=0.5, kl_beta=0.1)).loss(new, old, torch.tensor([2.0, 1.0]), ref)
    kl_normalised = ((math.exp(-0.25) + 0.25 - 1) + (math.exp(1 / 3) - 1 / 3 - 1)) / 2
    assert normalised.metrics["kl"] == pytest.approx(kl_normalised, abs=1e-6)


def test_untrained_draws_are_left_out():
    new = _score([-2.0, -9.0], [2, 3])
    new.mask = torch.tensor([[True], [False]])
    out = GDPO(GDPOConfig()).loss(new, torch.tensor([[-2.0], [-1.0]]), torch.tensor([1.0, 5.0]))
    assert float(out.loss) == pytest.approx(-1.0) and out.metrics["ratio_mean"] == pytest.approx(1.0)


def test_advantages_centre_by_default_and_scale_on_request():
    scores, groups = torch.tensor([1.0, 0.0, 0.0, 3.0]), torch.tensor([0, 0, 0, 1])
    torch.testing.assert_close(GDPO(GDPOConfig()).advantages(scores, groups),
                               torch.tensor([2 / 3, -1 / 3, -1 / 3, 0.0]))
    scaled = GDPO(algo_config(GDPOConfig, scale_rewards="group")).advantages(scores, groups)
    std = math.sqrt(((2 / 3) ** 2 + 2 * (1 / 3) ** 2) / 2)  # unbiased: n - 1 = 2
    assert float(scaled[0]) == pytest.approx((2 / 3) / (std + 1e-4), rel=1e-5)


def test_traits_and_plan_follow_the_options():
    plain, with_kl = GDPO(GDPOConfig()), GDPO(algo_config(GDPOConfig, kl_beta=0.04, draws=2))
    assert not plain.traits.needs_reference and plain.traits.zero_advantage_is_inert
    assert with_kl.traits.needs_reference and not with_kl.traits.zero_advantage_is_inert
    plan = with_kl.schedule(4, torch.Generator().manual_seed(0))
    assert plan.train_units == [[0], [1]] and plan.scoring == "likelihood" and plan.features() == {"likelihood", "elbo"}
    with pytest.raises(ValueError, match="draws 5 must not exceed the 4 decoding steps"):
        GDPO(algo_config(GDPOConfig, draws=5)).schedule(4)


@pytest.mark.parametrize(("key", "value"), [("draws", 0), ("clip_low", 0.0), ("clip_high", -1.0), ("kl_beta", -0.1)])
def test_bad_options_are_refused_naming_the_key(key, value):
    with pytest.raises(ValueError, match=key):
        algo_config(GDPOConfig, **{key: value})
