"""Reg-GRPO (DeepVideo-R1): the regression loss and its gradient against values worked out by hand, the group-centred
variant, the absence of a clip, the fixed point of the regression, and the pipelines that can or cannot feed it."""

from types import SimpleNamespace

import pytest
import torch

from mmgrpo import registry
from mmgrpo.preflight import require_scores
from mmgrpo.types import Score
from algorithm_options import algo_config

NEW = [[-1.0, -0.5, -2.0], [-0.3, -1.2, 0.0]]
OLD = [[-1.1, -0.5, -1.8], [-0.2, -1.0, 0.0]]
MASK = [[1, 1, 1], [1, 1, 0]]
ADV = [1.0, -0.5]
# mean token log-ratios: s_0 = (0.1 + 0 - 0.2) / 3 = -1/30, s_1 = (-0.1 - 0.2) / 2 = -0.15


def build(**options):
    cls = registry.get("algorithm", "reg_grpo")
    return cls(algo_config(cls.Config, **options))


def run(group_ids=None, adv=ADV, **options):
    new = Score(log_prob=torch.tensor(NEW, requires_grad=True), mask=torch.tensor(MASK, dtype=torch.bool),
                group_ids=None if group_ids is None else torch.tensor(group_ids))
    out = build(**options).loss(new, torch.tensor(OLD), torch.tensor(adv), None)
    return out, new


@pytest.mark.parametrize(("beta", "expected"), [
    (1.0, ((1 + 1 / 30) ** 2 + (-0.5 + 0.15) ** 2) / 2),  # (A - beta s)^2, mean over the 2 sequences
    (2.0, ((1 + 2 / 30) ** 2 + (-0.5 + 0.3) ** 2) / 2),
])
def test_loss_matches_hand_value(beta, expected):
    out, _ = run(reg_beta=beta)
    assert out.loss.item() == pytest.approx(expected, abs=1e-6)
    assert out.metrics["policy_loss"] == pytest.approx(expected, abs=1e-6)
    assert out.metrics["clip_frac"] == 0.0
    assert out.metrics["pred_adv"] == pytest.approx(beta * (1 / 30 + 0.15) / 2, abs=1e-6)


def test_gradient_matches_hand_value():
    """d loss / d log pi(o_it) = (1 / n) * 2 (beta s_i - A_i) * beta / |o_i| on scored tokens, 0 on padding."""
    out, new = run()
    out.loss.backward()
    row0 = (-1 / 30 - 1.0) / 3
    row1 = (-0.15 + 0.5) / 2
    expected = torch.tensor([[row0, row0, row0], [row1, row1, 0.0]])
    torch.testing.assert_close(new.log_prob.grad, expected, rtol=0, atol=1e-6)


def test_group_centred_prediction():
    # one group: P = R - mean(R), mean(R) = (-1/30 - 0.15) / 2 = -0.0916667 -> P = +-0.0583333
    out, _ = run(group_ids=[7, 7], center="group")
    expected = ((1 - 0.0583333) ** 2 + (-0.5 + 0.0583333) ** 2) / 2
    assert out.loss.item() == pytest.approx(expected, abs=1e-6)
    # each sample alone in its group: its centred prediction is 0, the loss is mean(A^2) and there is no gradient
    out, new = run(group_ids=[1, 2], center="group")
    assert out.loss.item() == pytest.approx((1 + 0.25) / 2, abs=1e-6)
    out.loss.backward()
    assert torch.count_nonzero(new.log_prob.grad) == 0


def test_no_clip_a_drifted_sample_keeps_its_gradient():
    """A ratio of 2 with a positive advantage: GRPO's clip zeroes the gradient, the regression does not, and past the
    target (beta s > A) it pulls the log-ratio back down."""
    log_ratio = torch.log(torch.tensor(2.0))
    for name, adv, sign in [("grpo", 1.0, None), ("reg_grpo", 1.0, -1), ("reg_grpo", 0.2, +1)]:
        cls = registry.get("algorithm", name)
        new = Score(log_prob=torch.full((1, 2), float(log_ratio), requires_grad=True))
        cls(algo_config(cls.Config, kl_beta=0.0)).loss(new, torch.zeros(1, 2), torch.tensor([adv]), None).loss.backward()
        if sign is None:
            assert torch.count_nonzero(new.log_prob.grad) == 0
        else:  # descent moves log pi by -grad: up when beta s = 0.69 < A = 1, down when 0.69 > A = 0.2
            assert torch.all(torch.sign(new.log_prob.grad) == sign)


def test_descent_reaches_the_fixed_point_log_ratio_equal_advantage_over_beta():
    log_prob = torch.zeros(2, 4, requires_grad=True)
    algorithm = build(reg_beta=0.5)
    adv = torch.tensor([0.8, -0.4])
    optimizer = torch.optim.SGD([log_prob], lr=2.0)
    for _ in range(300):
        optimizer.zero_grad()
        algorithm.loss(Score(log_prob=log_prob), torch.zeros(2, 4), adv, None).loss.backward()
        optimizer.step()
    torch.testing.assert_close(log_prob.detach().mean(dim=1), adv / 0.5, rtol=0, atol=1e-4)


def test_traits_and_pipelines():
    plain, centred = build(), build(center="group")
    assert plain.traits.reads == {"log_prob", "mask"} and centred.traits.reads == {"log_prob", "mask", "group_ids"}
    assert not plain.traits.zero_advantage_is_inert  # a zero advantage still regresses the log-ratio to 0
    assert not plain.traits.needs_reference and build(kl_beta=0.04).traits.needs_reference
    names = SimpleNamespace(algorithm=SimpleNamespace(name="reg_grpo"), pipeline=SimpleNamespace(name="qwen_vl"))
    require_scores(registry.get("pipeline", "qwen_vl"), plain, names)  # accepted
    with pytest.raises(ValueError, match=r"reads the score field.*'group_ids'"):
        require_scores(registry.get("pipeline", "qwen_vl"), centred, names)
    with pytest.raises(ValueError, match="reg_beta must be >= 0.001"):
        algo_config(registry.get("algorithm", "reg_grpo").Config, reg_beta=0.0)
    with pytest.raises(ValueError, match="center"):
        algo_config(registry.get("algorithm", "reg_grpo").Config, center="batch")
