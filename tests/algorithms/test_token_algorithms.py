"""Token-level algorithms (grpo, dr_grpo, dapo, gspo, sapo): each loss against a value computed by hand with scalar
Python on a small example, advantages, group size 2, and the gradient facts each loss is built on."""

import math

import pytest
import torch

from mmgrpo import registry
from mmgrpo.types import Score
from mmgrpo.validation import build_dataclass

TOKEN_ALGORITHMS = ["grpo", "dr_grpo", "dapo", "gspo", "sapo"]
NEW = [[-1.0, -0.5, -2.0], [-0.3, -1.2, 0.0]]
OLD = [[-1.1, -0.5, -1.8], [-0.2, -1.0, 0.0]]
REF = [[-1.0, -0.7, -2.0], [-0.3, -1.0, 0.0]]
MASK = [[1, 1, 1], [1, 1, 0]]
ADV = [1.0, -0.5]


def build(name, **options):
    """Algorithm `name` with the flat options of a config file's ``algorithm:`` section."""
    cls = registry.get("algorithm", name)
    return cls(build_dataclass(cls.Config, options, "algorithm"))


def run_loss(name, adv=ADV, with_ref=False, **options):
    algorithm = build(name, **options)
    new = Score(log_prob=torch.tensor(NEW, requires_grad=True), mask=torch.tensor(MASK, dtype=torch.bool))
    ref = Score(log_prob=torch.tensor(REF)) if with_ref else None
    out = algorithm.loss(new, torch.tensor(OLD), torch.tensor(adv), ref)
    return out, new


def tokens(row):
    return [t for t in range(3) if MASK[row][t]]


def clip_term(a, r, low, high):
    return max(-a * r, -a * min(max(r, 1 - low), 1 + high))


def k3(row, t):
    d = REF[row][t] - NEW[row][t]
    return math.exp(d) - d - 1


def test_grpo_matches_hand_computed_value_with_kl():
    # per-sequence token mean, then mean over the 2 sequences; ratios 1.105, 1, 0.819 | 0.905, 0.819 (inside 0.8..1.2)
    policy = (-(1.105171 + 1.0 + 0.818731) / 3 + 0.5 * (0.904837 + 0.818731) / 2) / 2
    kl = ((math.exp(-0.2) + 0.2 - 1) / 3 + (math.exp(0.2) - 0.2 - 1) / 2) / 2
    out, _ = run_loss("grpo", with_ref=True, kl_beta=0.04)
    assert out.loss.item() == pytest.approx(policy + 0.04 * kl, abs=1e-5)
    assert out.metrics["kl"] == pytest.approx(kl, abs=1e-6)
    assert out.metrics["clip_frac"] == 0.0


def test_grpo_clip_binds_and_zeroes_gradient():
    out, new = run_loss("grpo", kl_beta=0.0, clip_low=0.1, clip_high=0.05)  # r=1.105 > 1.05 (A>0), 0.819 < 0.9 (A>0)
    expected = sum(sum(clip_term(ADV[i], math.exp(NEW[i][t] - OLD[i][t]), 0.1, 0.05) for t in tokens(i)) / len(tokens(i))
                   for i in range(2)) / 2
    assert out.loss.item() == pytest.approx(expected, abs=1e-6)
    out.loss.backward()
    grad = new.log_prob.grad
    assert grad[0, 0] == 0  # clipped above with a positive advantage
    assert grad[0, 2] != 0  # below 1 - eps with A > 0: max picks the unclipped term, gradient flows (PPO's rule)
    assert grad[1, 2] == 0  # padding


def test_dr_grpo_sums_tokens_over_fixed_length():
    expected = sum(clip_term(ADV[i], math.exp(NEW[i][t] - OLD[i][t]), 0.2, 0.2) for i in range(2) for t in tokens(i))
    out, _ = run_loss("dr_grpo")
    assert out.loss.item() == pytest.approx(expected / (2 * 3), abs=1e-6)
    adv = build("dr_grpo").advantages(torch.tensor([1.0, 3.0, 5.0, 5.0]), torch.tensor([0, 0, 1, 1]))
    torch.testing.assert_close(adv, torch.tensor([-1.0, 1.0, 0.0, 0.0]))  # mean-centred, not scaled


def test_dapo_clip_higher_token_mean_and_the_samples_counted():
    terms = [clip_term(ADV[i], math.exp(NEW[i][t] - OLD[i][t]), 0.2, 0.28) for i in range(2) for t in tokens(i)]
    out, _ = run_loss("dapo")
    assert out.loss.item() == pytest.approx(sum(terms) / 5, abs=1e-6)  # every token weighs the same
    assert out.entries == 5 and build("dapo").traits.update_mean == "rollout_entries"  # TRL's count: the rollout's
    row0 = [clip_term(1.0, math.exp(NEW[0][t] - OLD[0][t]), 0.2, 0.28) for t in range(3)]
    counted, _ = run_loss("dapo", adv=[1.0, 0.0])  # TRL counts the tokens of a zero-advantage sample
    assert counted.loss.item() == pytest.approx(sum(row0) / 5, abs=1e-6) and counted.entries == 5
    out, new = run_loss("dapo", adv=[1.0, 0.0], token_mean="update_with_signal")  # left out of the count
    assert out.loss.item() == pytest.approx(sum(row0) / 3, abs=1e-6) and out.entries == 3
    assert out.metrics["kept_fraction"] == 0.5
    assert build("dapo", token_mean="update").traits.update_mean == "entries"
    # clip-higher: a ratio of 1.25 is inside the window for a positive advantage
    algorithm = build("dapo")
    new = Score(log_prob=torch.tensor([[math.log(1.25)]], requires_grad=True))
    algorithm.loss(new, torch.zeros(1, 1), torch.ones(1), None).loss.backward()
    assert new.log_prob.grad.abs().item() > 0


def test_gspo_sequence_ratio_and_clip():
    expected = 0.0
    for i in range(2):
        s = math.exp(sum(NEW[i][t] - OLD[i][t] for t in tokens(i)) / len(tokens(i)))
        expected += clip_term(ADV[i], s, 3e-4, 4e-4) / 2
    out, new = run_loss("gspo")
    assert out.loss.item() == pytest.approx(expected, abs=1e-6)
    out.loss.backward()
    assert torch.all(new.log_prob.grad[1] == 0)  # s_1 = 0.86 < 1 - 3e-4 with A < 0: clipped, no gradient
    assert torch.all(new.log_prob.grad[0, :3] != 0)  # A > 0 below the window: unclipped, shared by every token


def test_sapo_soft_gate_value_and_gradient():
    expected = 0.0
    for i in range(2):
        tau = 1.0 if ADV[i] > 0 else 1.05
        gate = [1 / (1 + math.exp(-tau * (math.exp(NEW[i][t] - OLD[i][t]) - 1))) * 4 / tau for t in tokens(i)]
        expected += sum(-g * ADV[i] for g in gate) / len(tokens(i)) / 2
    out, _ = run_loss("sapo")
    assert out.loss.item() == pytest.approx(expected, abs=1e-6)
    # on-policy the gate's gradient equals the plain policy gradient: d/dlogp = -A / |o_i| / n
    algorithm = build("sapo")
    new = Score(log_prob=torch.zeros(2, 2, requires_grad=True), mask=torch.ones(2, 2, dtype=torch.bool))
    algorithm.loss(new, torch.zeros(2, 2), torch.tensor([1.0, -2.0]), None).loss.backward()
    torch.testing.assert_close(new.log_prob.grad, torch.tensor([[-0.25, -0.25], [0.5, 0.5]]))


@pytest.mark.parametrize("name", TOKEN_ALGORITHMS)
def test_on_policy_ratio_one_zero_advantage_zero_gradient_and_group_size_two(name):
    algorithm = build(name)
    plan = algorithm.schedule(5)
    assert plan.train_units == [[0, 1, 2, 3, 4]] and not plan.greedy and not plan.features() and plan.family == "token"
    adv = algorithm.advantages(torch.tensor([1.0, 0.0, 0.5, 0.5]), torch.tensor([7, 7, 9, 9]))  # G = 2
    assert adv[0] > 0 > adv[1] and adv[2] == 0 and adv[3] == 0
    log_prob = torch.randn(4, 5, generator=torch.Generator().manual_seed(0))
    new = Score(log_prob=log_prob.clone().requires_grad_(True), mask=torch.ones(4, 5, dtype=torch.bool))
    ref = Score(log_prob=log_prob - 0.1) if algorithm.traits.needs_reference else None
    out = algorithm.loss(new, log_prob, torch.zeros(4), ref)
    assert out.metrics["ratio_mean"] == pytest.approx(1.0) and out.metrics["clip_frac"] == 0.0
    if ref is None:
        out.loss.backward()
        assert torch.count_nonzero(new.log_prob.grad) == 0
    empty = Score(log_prob=log_prob.clone().requires_grad_(True), mask=torch.zeros(4, 5, dtype=torch.bool))
    out = algorithm.loss(empty, log_prob, torch.ones(4), None)
    out.loss.backward()
    assert out.loss.item() == 0.0 and torch.count_nonzero(empty.log_prob.grad) == 0


@pytest.mark.parametrize("name", TOKEN_ALGORITHMS)
def test_config_errors_teach(name):
    cls = registry.get("algorithm", name)
    with pytest.raises(ValueError, match=r"^algorithm\.kl_beta must be >= 0"):
        build_dataclass(cls.Config, {"kl_beta": -1.0}, "algorithm")
