"""AWM: the loss against the authors' published rule (Flow-Factory ``trainers/awm.py``) written out on the same
tensors for every weighting, zero advantage, the EMA's decay and clock, the stratified time sampling, exact resume and
the config's checks."""

import pytest
import torch

from mmgrpo.algorithms.awm import AWM, AWMConfig, stratified_levels
from mmgrpo.types import Score
from mmgrpo.validation import ConfigError

from builders._runs import check_resume_is_exact
from builders._weights import Weights, read_old
from algorithm_options import algo_config

WEIGHTINGS = ["Uniform", "t", "t**2", "huber", "ghuber"]


def authors_log_prob(model_output, target, t, weighting, ghuber_power=0.25):
    """``AWMTrainer.compute_weighted_log_prob``, written out (``t`` already the noise level ``sigma``)."""
    model_output, target = model_output.double(), target.double()
    log_prob = -(model_output - target) ** 2
    log_prob = log_prob.mean(dim=tuple(range(1, log_prob.ndim)))
    t = t.double()
    if weighting == "t":
        log_prob = log_prob * t
    elif weighting == "t**2":
        log_prob = log_prob * t**2
    elif weighting == "huber":
        log_prob = -(torch.sqrt(-log_prob + 1e-10) - 1e-5) * t
    elif weighting == "ghuber":
        eps = torch.tensor(1e-10, dtype=log_prob.dtype)
        log_prob = -(torch.pow(-log_prob + eps, ghuber_power) - torch.pow(eps, ghuber_power)) * t / ghuber_power
    return log_prob.float()


def authors_loss(v, target, t, v_ref, v_ema, adv, weighting, clip_range=(-1.0, 1.0), adv_clip=(-1.0, 1.0),
                 kl_beta=1e-4, ema_kl_beta=1.0, advantage_max=None):
    """One timestep of ``AWMTrainer.optimize`` (published config: clip_range 1, adv_clip_range 1.0): the old log-probs
    are computed under the same (current) weights just before training, the PPO clip, and both velocity KLs. With
    `advantage_max`, the authors' own training script's rescaling of the clamped advantages (``advantages /
    adv_clip_max * advantage_max``)."""
    with torch.no_grad():
        old_log_prob = authors_log_prob(v, target, t, weighting)
    log_prob = authors_log_prob(v, target, t, weighting)
    adv = torch.clamp(adv, adv_clip[0], adv_clip[1])
    if advantage_max is not None:
        adv = adv / adv_clip[1] * advantage_max
    ratio = torch.exp(log_prob - old_log_prob)
    unclipped_loss = -adv * ratio
    clipped_loss = -adv * torch.clamp(ratio, 1.0 + clip_range[0], 1.0 + clip_range[1])
    loss = torch.mean(torch.maximum(unclipped_loss, clipped_loss))
    loss = loss + kl_beta * ((v - v_ref) ** 2).mean(dim=tuple(range(1, v.ndim))).mean()
    return loss + ema_kl_beta * ((v - v_ema) ** 2).mean(dim=tuple(range(1, v.ndim))).mean()


def tensors(seed=0, n=5, shape=(3, 4, 4)):
    g = torch.Generator().manual_seed(seed)
    target = torch.randn(n, *shape, generator=g)
    v = (target + 0.5 * torch.randn(n, *shape, generator=g)).requires_grad_(True)
    v_ref = v.detach() + 0.05 * torch.randn(n, *shape, generator=g)
    v_ema = v.detach() + 0.02 * torch.randn(n, *shape, generator=g)
    t = torch.rand(n, generator=g)
    adv = torch.tensor([2.0, 0.7, 0.0, -0.3, -1.6])[:n]  # some beyond the published clamp 1.0
    return v, target, t, v_ref, v_ema, adv


def score(v, target, t):
    dims = tuple(range(1, v.dim()))
    return Score(log_prob=-((v - target) ** 2).mean(dim=dims)[:, None], velocity=v[:, None], target=target[:, None],
                 sigma=t[:, None])


@pytest.mark.parametrize("weighting", WEIGHTINGS)
def test_loss_equals_the_authors_rule(weighting):
    v, target, t, v_ref, v_ema, adv = tensors()
    algorithm = AWM(algo_config(AWMConfig, awm_weighting=weighting))
    out = algorithm.loss(score(v, target, t), score(v_ema, target, t), adv, score(v_ref, target, t))
    (grad,) = torch.autograd.grad(out.loss, v)
    expected = authors_loss(v, target, t, v_ref, v_ema, adv, weighting)
    (expected_grad,) = torch.autograd.grad(expected, v)
    torch.testing.assert_close(out.loss, expected, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-4, atol=1e-8)
    assert out.metrics["ratio_mean"] == 1.0


def test_advantage_max_is_the_authors_rescaling():
    """The authors' GenEval configuration: advantages clamped at 5, rescaled into [-1, 1], reference KL 0.003."""
    v, target, t, v_ref, v_ema, adv = tensors(2)
    adv = adv * 4  # [8, 2.8, 0, -1.2, -6.4]: one beyond the clamp at 5
    algorithm = AWM(algo_config(AWMConfig, adv_clip_max=5.0, advantage_max=1.0, kl_beta=0.003))
    out = algorithm.loss(score(v, target, t), score(v_ema, target, t), adv, score(v_ref, target, t))
    expected = authors_loss(v, target, t, v_ref, v_ema, adv, "ghuber", adv_clip=(-5.0, 5.0), kl_beta=0.003,
                            advantage_max=1.0)
    torch.testing.assert_close(out.loss, expected, rtol=1e-5, atol=1e-7)
    (grad,) = torch.autograd.grad(out.loss, v)
    (expected_grad,) = torch.autograd.grad(expected, v)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-4, atol=1e-8)
    unscaled = AWM(algo_config(AWMConfig, adv_clip_max=5.0, kl_beta=0.0, ema_kl_beta=0.0))
    scaled = AWM(algo_config(AWMConfig, adv_clip_max=5.0, advantage_max=1.0, kl_beta=0.0, ema_kl_beta=0.0))
    plain = unscaled.loss(score(v, target, t), None, adv).loss
    torch.testing.assert_close(scaled.loss(score(v, target, t), None, adv).loss, plain / 5)  # the policy term / 5


def test_defaults_are_the_published_configuration():
    c = AWMConfig()
    assert (c.awm_weighting, c.ghuber_power, c.num_train_timesteps, c.time_sampling_strategy, c.step_range) == (
        "ghuber", 0.25, 6, "discrete_wo_init", 0.9)
    assert (c.kl.kl_beta, c.ema_kl_beta, c.ema_decay, c.ema_warmup_steps) == (1e-4, 1.0, 0.3, 1000)
    assert (c.advantage.scale_rewards, c.advantage.adv_std, c.advantage.adv_clip_max, c.solver) == (
        "batch", "population", 1.0, "flow")
    assert c.advantage_max is None  # Flow-Factory's configuration does not rescale


def test_the_gradient_is_the_advantage_times_the_weighted_matching_gradient_and_zero_at_zero_advantage():
    v, target, t, _, _, adv = tensors(1)
    algorithm = AWM(algo_config(AWMConfig, awm_weighting="t", kl_beta=0.0, ema_kl_beta=0.0))
    assert algorithm.traits.zero_advantage_is_inert and algorithm.traits.old_source == "current"
    (grad,) = torch.autograd.grad(algorithm.loss(score(v, target, t), None, adv).loss, v)
    weighted = (((v - target) ** 2).mean(dim=(1, 2, 3)) * t)  # [n] t * l
    (expected,) = torch.autograd.grad((adv.clamp(-1, 1) * weighted).mean(), v)
    torch.testing.assert_close(grad, expected, rtol=1e-5, atol=1e-8)
    assert torch.count_nonzero(grad[2]) == 0  # advantage 0: nothing
    # with the KL terms, a zero advantage gives no gradient where the policy is its reference and its EMA
    kl = AWM(AWMConfig())
    assert not kl.traits.zero_advantage_is_inert and kl.traits.old_source == "old_model" and kl.traits.old_score
    same = score(v.detach(), target, t)
    (grad,) = torch.autograd.grad(kl.loss(score(v, target, t), same, torch.zeros(5), same).loss, v)
    assert torch.count_nonzero(grad) == 0


def test_ema_decay_rises_linearly_once_per_step_and_resumes_exactly():
    """Flow-Factory's ``ema_step(step=epoch)`` after each epoch's optimisation, ``linear_warmup_decay(0.3, 0, 1000)``:
    the first epoch's step copies the weights (decay 0); the EMA starts at the initial weights."""
    algorithm = AWM(AWMConfig())
    assert [algorithm.ema_decay(e) for e in (0, 1, 500, 1000, 5000)] == pytest.approx([0.0, 3e-4, 0.15, 0.3, 0.3])
    algorithm = AWM(algo_config(AWMConfig, ema_decay=0.5, ema_warmup_steps=2))
    policy = Weights()
    assert torch.equal(read_old(algorithm, policy), torch.zeros(3))
    ema = torch.zeros(3)
    for epoch, updates in enumerate((1, 2, 1)):
        for _ in range(updates):
            with torch.no_grad():
                policy.params[0].add_(1.0)
            torch.testing.assert_close(read_old(algorithm, policy), ema)  # unchanged within the epoch
        algorithm.after_step()
        decay = 0.5 * min(epoch / 2, 1.0)
        ema = decay * ema + (1 - decay) * policy.params[0].detach()
        torch.testing.assert_close(read_old(algorithm, policy), ema)
    algorithm.after_step()  # owed at a checkpoint, taken after the resume
    resumed = AWM(algo_config(AWMConfig, ema_decay=0.5, ema_warmup_steps=2))
    resumed.load_state_dict(algorithm.state_dict())
    assert resumed.steps == 4 and resumed.ema.owed == [0.5]
    assert torch.equal(read_old(resumed, policy), read_old(algorithm, policy))
    off = AWM(algo_config(AWMConfig, ema_kl_beta=0.0))
    off.after_step()  # without the EMA KL no EMA is kept
    assert off.ema.shadow is None and off.ema.owed == [] and off.steps == 1


def authors_discrete(num_train_timesteps, start_idx, max_idx, rand_u):
    """``TimeSampler._stratified_sample`` written out with given uniforms."""
    boundaries = torch.linspace(start_idx, max_idx, num_train_timesteps + 1)
    lower, upper = boundaries[:-1].long(), boundaries[1:].long()
    return (lower + (rand_u * (upper - lower)).long()).tolist()


def test_time_sampling_is_the_authors_stratified_draw_over_step_indices():
    c = AWMConfig()  # 6 levels, discrete_wo_init, range 0.9
    for steps in (10, 14):
        levels = stratified_levels(steps, c, torch.Generator().manual_seed(3))
        rand_u = torch.rand(6, generator=torch.Generator().manual_seed(3))
        assert levels == authors_discrete(6, 1, int(0.9 * steps), rand_u)
        assert 0 not in levels  # never the pure-noise level
    init = algo_config(AWMConfig, time_sampling_strategy="discrete_with_init", num_train_timesteps=3)
    rand_u = torch.rand(2, generator=torch.Generator().manual_seed(4))
    assert stratified_levels(10, init, torch.Generator().manual_seed(4)) == [0] + authors_discrete(2, 1, 9, rand_u)
    plain = algo_config(AWMConfig, time_sampling_strategy="discrete", num_train_timesteps=2)
    rand_u = torch.rand(2, generator=torch.Generator().manual_seed(5))
    assert stratified_levels(10, plain, torch.Generator().manual_seed(5)) == authors_discrete(2, 0, 9, rand_u)
    plan = AWM(c).schedule(10, torch.Generator().manual_seed(0))
    assert plan.likelihood_noise == "sample" and plan.solver == "flow" and len(plan.train_units) == 6
    assert plan.features() == {"likelihood", "sample_noise"}


def test_resume_restores_the_ema_exactly(tmp_path, tiny_sd3_dir):
    options = {"name": "awm", "num_train_timesteps": 2, "ema_decay": 0.5, "ema_warmup_steps": 2}
    check_resume_is_exact(tmp_path, tiny_sd3_dir, options, lambda algorithm: algorithm.steps)


@pytest.mark.parametrize(("options", "message"), [
    ({"awm_weighting": "cubic"}, "awm_weighting"),
    ({"ghuber_power": 0.0}, "ghuber_power must be > 0"),
    ({"num_train_timesteps": 0}, "num_train_timesteps must be >= 1"),
    ({"time_sampling_strategy": "logit_normal"}, "time_sampling_strategy"),
    ({"step_range": 1.5}, "step_range must be <= 1"),
    ({"ema_kl_beta": -1.0}, "ema_kl_beta must be >= 0"),
    ({"ema_decay": 1.0}, "ema_decay must be < 1"),
    ({"ema_warmup_steps": 0}, "ema_warmup_steps must be >= 1"),
    ({"advantage_max": 0.0}, "advantage_max must be > 0"),
    ({"advantage_max": 1.0, "adv_clip_max": None}, "set adv_clip_max too"),
])
def test_config_refuses_bad_options(options, message):
    with pytest.raises(ConfigError, match=message):
        algo_config(AWMConfig, **options)
