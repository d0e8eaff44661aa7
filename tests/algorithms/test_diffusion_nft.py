"""DiffusionNFT: the loss against the authors' published rule written out on the same tensors, its on-policy and
zero-advantage properties, the old model's EMA decay schedules and clock, the per-sample likelihood noise, exact resume
and the config's checks."""

import pytest
import torch

from mmgrpo.algorithms.diffusion_nft import DiffusionNFT, DiffusionNFTConfig, nft_decay
from mmgrpo.pipelines.sd3 import SD3Config, SD3Policy
from mmgrpo.plans import FlowPlan
from mmgrpo.samplers.flow_likelihood import sample_noise
from mmgrpo.samplers.flow_plan import group_noise
from mmgrpo.types import PromptBatch, Score
from mmgrpo.validation import ConfigError

from builders._runs import check_resume_is_exact
from builders._weights import Weights, read_old
from algorithm_options import algo_config


def authors_loss(x0, eps, t, v, v_old, v_ref, adv, beta=1.0, kl_beta=1e-4, adv_clip_max=5.0):
    """``scripts/train_nft_sd3.py`` (NVlabs/DiffusionNFT) on one timestep of a micro-batch, written out: x0 `[n, ...]`,
    eps `[n, ...]`, t `[n]`, the trained, old and reference velocities `[n, ...]`, advantages `[n]`."""
    t_expanded = t.view(-1, *([1] * (x0.dim() - 1)))
    xt = (1 - t_expanded) * x0 + t_expanded * eps
    advantages_clip = torch.clamp(adv, -adv_clip_max, adv_clip_max)
    r = torch.clamp((advantages_clip / adv_clip_max) / 2.0 + 0.5, 0, 1)
    positive_prediction = beta * v + (1 - beta) * v_old.detach()
    implicit_negative_prediction = (1.0 + beta) * v_old.detach() - beta * v
    dims = tuple(range(1, x0.dim()))
    x0_prediction = xt - t_expanded * positive_prediction
    with torch.no_grad():
        weight_factor = torch.abs(x0_prediction.double() - x0.double()).mean(dim=dims, keepdim=True).clip(min=0.00001)
    positive_loss = ((x0_prediction - x0) ** 2 / weight_factor).mean(dim=dims)
    negative_x0_prediction = xt - t_expanded * implicit_negative_prediction
    with torch.no_grad():
        negative_weight_factor = torch.abs(negative_x0_prediction.double() - x0.double()).mean(
            dim=dims, keepdim=True).clip(min=0.00001)
    negative_loss = ((negative_x0_prediction - x0) ** 2 / negative_weight_factor).mean(dim=dims)
    ori_policy_loss = r * positive_loss / beta + (1.0 - r) * negative_loss / beta
    policy_loss = (ori_policy_loss * adv_clip_max).mean()
    kl_div_loss = ((v - v_ref) ** 2).mean(dim=dims)
    return policy_loss + kl_beta * torch.mean(kl_div_loss)


def tensors(seed=0, n=6, shape=(3, 4, 4)):
    g = torch.Generator().manual_seed(seed)
    x0, eps = torch.randn(n, *shape, generator=g), torch.randn(n, *shape, generator=g)
    t = torch.rand(n, generator=g)
    v = (eps - x0 + 0.3 * torch.randn(n, *shape, generator=g)).requires_grad_(True)
    v_old = v.detach() + 0.05 * torch.randn(n, *shape, generator=g)
    v_ref = v.detach() + 0.05 * torch.randn(n, *shape, generator=g)
    adv = torch.tensor([7.0, 2.0, 0.5, 0.0, -1.5, -6.0])[:n]  # some beyond A_max = 5
    return x0, eps, t, v, v_old, v_ref, adv


def score(v, x0, eps, t):
    """The likelihood's Score at one noise level per sample (`k` = 1)."""
    target = eps - x0
    dims = tuple(range(1, v.dim()))
    return Score(log_prob=-((v - target) ** 2).mean(dim=dims)[:, None], velocity=v[:, None], target=target[:, None],
                 sigma=t[:, None])


@pytest.mark.parametrize("beta", [1.0, 0.1])
def test_loss_equals_the_authors_rule(beta):
    x0, eps, t, v, v_old, v_ref, adv = tensors()
    algorithm = DiffusionNFT(algo_config(DiffusionNFTConfig, beta=beta))
    out = algorithm.loss(score(v, x0, eps, t), score(v_old, x0, eps, t), adv, score(v_ref, x0, eps, t))
    (grad,) = torch.autograd.grad(out.loss, v)
    expected = authors_loss(x0, eps, t, v, v_old, v_ref, adv, beta=beta)
    (expected_grad,) = torch.autograd.grad(expected, v)
    torch.testing.assert_close(out.loss, expected.float(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad, expected_grad.float(), rtol=1e-4, atol=1e-7)


def test_defaults_are_the_authors():
    c = DiffusionNFTConfig()
    assert (c.beta, c.decay_type, c.kl.kl_beta, c.advantage.adv_clip_max, c.level_fraction) == (1.0, 1, 1e-4, 5.0, 0.99)
    assert (c.advantage.scale_rewards, c.advantage.adv_std, c.advantage.adv_eps) == ("batch", "population", 1e-4)
    scores = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0])
    groups = torch.tensor([0, 0, 0, 1, 1, 1])
    # the authors' PerPromptStatTracker with global_std: the group mean over the batch's numpy std + 1e-4
    expected = torch.tensor([2 / 3, -1 / 3, -1 / 3, 0.0, 0.0, 0.0]) / (scores.std(unbiased=False) + 1e-4)
    torch.testing.assert_close(DiffusionNFT(c).advantages(scores, groups), expected)


def test_on_policy_the_implicit_policies_are_the_model_and_the_gradient_does_not_depend_on_beta():
    """With ``v_old = v``: ``v+ = v- = v``, so ``L+ = L-`` (the loss does not depend on r) and the policy gradient is
    ``(2r - 1) A_max`` times the gradient of the adaptively weighted x0 loss of ``v``, for any beta."""
    x0, eps, t, v, _, _, adv = tensors(1)
    new, old = score(v, x0, eps, t), score(v.detach(), x0, eps, t)
    grads = {}
    for beta in (1.0, 0.3):
        algorithm = DiffusionNFT(algo_config(DiffusionNFTConfig, beta=beta, kl_beta=0.0))
        high = algorithm.loss(new, old, torch.full((6,), 5.0)).loss  # r = 1: L+
        low = algorithm.loss(new, old, torch.full((6,), -5.0)).loss  # r = 0: L-
        torch.testing.assert_close(high, low)
        (grads[beta],) = torch.autograd.grad(algorithm.loss(new, old, adv).loss, v)
    torch.testing.assert_close(grads[1.0], grads[0.3], rtol=1e-4, atol=1e-6)  # beta 0.3 mixes v with v_old: rounding
    t4 = t.view(-1, 1, 1, 1)
    error = t4 * ((eps - x0) - v)  # x0_hat - x0
    weight = error.detach().abs().mean(dim=(1, 2, 3), keepdim=True)
    r = (adv.clamp(-5, 5) / 10 + 0.5).clamp(0, 1)
    (expected,) = torch.autograd.grad(((2 * r - 1) * 5 * (error**2 / weight).mean(dim=(1, 2, 3))).mean(), v)
    torch.testing.assert_close(grads[1.0], expected, rtol=1e-4, atol=1e-6)


def test_zero_advantage_gives_no_gradient_on_policy_but_does_off_policy():
    x0, eps, t, v, v_old, _, _ = tensors(2)
    algorithm = DiffusionNFT(algo_config(DiffusionNFTConfig, kl_beta=0.0))
    assert not algorithm.traits.zero_advantage_is_inert  # r = 1/2 still pulls v towards v_old
    on = algorithm.loss(score(v, x0, eps, t), score(v.detach(), x0, eps, t), torch.zeros(6)).loss
    assert torch.count_nonzero(torch.autograd.grad(on, v)[0]) == 0
    off = algorithm.loss(score(v, x0, eps, t), score(v_old, x0, eps, t), torch.zeros(6)).loss
    assert torch.count_nonzero(torch.autograd.grad(off, v)[0]) > 0


def test_optimality_probability_and_adv_modes():
    adv = torch.tensor([-7.0, -2.5, 0.0, 2.5, 7.0])
    r = {m: DiffusionNFT(algo_config(DiffusionNFTConfig, adv_mode=m)).optimality(adv).tolist()
         for m in ("all", "positive_only", "negative_only", "one_only", "binary")}
    assert r["all"] == [0.0, 0.25, 0.5, 0.75, 1.0]
    assert r["positive_only"] == [0.5, 0.5, 0.5, 0.75, 1.0] and r["negative_only"] == [0.0, 0.25, 0.5, 0.5, 0.5]
    assert r["one_only"] == pytest.approx([0.5, 0.5, 0.5, 0.6, 0.6])
    assert r["binary"] == pytest.approx([0.4, 0.4, 0.5, 0.6, 0.6])


def test_decay_schedules_are_the_authors():
    assert [nft_decay(u, 0) for u in (0, 10, 1000)] == [0.0, 0.0, 0.0]
    assert [nft_decay(u, 1) for u in (0, 1, 250, 500, 2000)] == [0.0, 0.001, 0.25, 0.5, 0.5]
    assert [nft_decay(u, 2) for u in (0, 74, 75, 76, 100)] == [0.0, 0.0, 0.0, 0.0075, pytest.approx(0.1875)]
    assert nft_decay(10**5, 2) == 0.999


def test_the_old_model_follows_the_weights_once_per_step_on_the_update_clock():
    """As the authors' epoch loop: the old model starts at the initial weights (copied before training), and after
    each rollout epoch, whatever its number of updates, ``old <- d old + (1 - d) theta`` with ``d =
    return_decay(global_step)``, ``global_step`` the optimizer updates taken so far (counted before it is read)."""
    policy = Weights()
    algorithm = DiffusionNFT(algo_config(DiffusionNFTConfig, decay_type=1))
    assert torch.equal(read_old(algorithm, policy), torch.zeros(3))  # the first read: the initial weights
    old, global_step = torch.zeros(3), 0
    for updates_this_step in (2, 1, 3):  # the authors' epochs of one or more gradient steps
        for _ in range(updates_this_step):
            with torch.no_grad():
                policy.params[0].add_(1.0)
            algorithm.kl.step()  # the trainer counts every optimizer update taken
            global_step += 1
            torch.testing.assert_close(read_old(algorithm, policy), old)  # unchanged within the epoch
        algorithm.after_step()
        decay = nft_decay(global_step, 1)
        old = decay * old + (1 - decay) * policy.params[0].detach()
        torch.testing.assert_close(read_old(algorithm, policy), old)
    assert [nft_decay(u, 1) for u in (2, 3, 6)] == [0.002, 0.003, 0.006]
    # a checkpoint between the end of a step and the next read resumes the owed step exactly
    algorithm.kl.step()
    algorithm.after_step()
    resumed = DiffusionNFT(algo_config(DiffusionNFTConfig, decay_type=1))
    resumed.load_state_dict(algorithm.state_dict())
    assert resumed.ema.owed == [nft_decay(7, 1)]
    assert torch.equal(read_old(resumed, policy), read_old(algorithm, policy))


def test_schedule_trains_most_sampling_levels_with_per_sample_noise():
    plan = DiffusionNFT(DiffusionNFTConfig()).schedule(10, torch.Generator().manual_seed(0))
    levels = plan.trained_steps
    assert len(levels) == 9 and len(set(levels)) == 9 and all(len(u) == 1 for u in plan.train_units)  # int(0.99 * 10)
    assert plan.likelihood_noise == "sample" and plan.features() == {"dpm", "likelihood", "sample_noise"}
    again = DiffusionNFT(DiffusionNFTConfig()).schedule(10, torch.Generator().manual_seed(0))
    assert not plan.sde_steps and plan == again
    with pytest.raises(ValueError, match="likelihood_noise must be 'group' or 'sample'"):
        FlowPlan(num_steps=4, sde_steps=[], train_units=[[0]], scoring="likelihood", likelihood_noise="batch")


def test_likelihood_noise_is_per_sample_and_the_same_in_every_pass(tiny_sd3_dir):
    policy = SD3Policy(SD3Config(pretrained=tiny_sd3_dir, resolution=32, num_steps=4, guidance_scale=1.0, lora_rank=4,
                                 max_sequence_length=16))
    algorithm = DiffusionNFT(DiffusionNFTConfig())
    plan = algorithm.schedule(4, torch.Generator().manual_seed(0))
    rollout = policy.sample(PromptBatch(["a red circle", "two blue squares"]).repeat(3), plan,
                            generator=torch.Generator().manual_seed(1))
    j = plan.train_units[0][0]
    with torch.no_grad():
        got = policy.likelihood(rollout, [j])
        halves = [policy.likelihood(rollout.select(torch.tensor(rows)), [j]) for rows in ([0, 3, 4], [1, 2, 5])]
    eps = sample_noise(policy._noise, rollout.group_ids, torch.tensor([0, 1, 2, 0, 1, 2]), plan.seed, salt=j)
    assert not torch.equal(eps[0], eps[1])  # each sample its own noise, within a group too
    x0 = rollout.trajectory["latents"][:, -1]
    torch.testing.assert_close(got.target[:, 0], eps - x0)
    assert torch.equal(got.sigma, rollout.trajectory["shared_sigmas"][j].expand(6, 1))
    # any minibatch of the samples scores each of them at the same point
    torch.testing.assert_close(halves[0].target[:, 0], got.target[[0, 3, 4], 0])
    torch.testing.assert_close(halves[1].log_prob, got.log_prob[[1, 2, 5]], rtol=1e-5, atol=1e-6)
    # DGPO's group noise is unchanged: shared within a group
    shared = group_noise(policy._noise, rollout.group_ids, plan.seed, salt=j)
    assert torch.equal(shared[0], shared[2]) and not torch.equal(shared[0], shared[3])


def test_resume_restores_the_old_model_exactly(tmp_path, tiny_sd3_dir):
    options = {"name": "diffusion_nft", "decay_type": 1, "level_fraction": 0.67}
    check_resume_is_exact(tmp_path, tiny_sd3_dir, options, lambda algorithm: algorithm.kl.updates)


@pytest.mark.parametrize(("options", "message"), [
    ({"beta": 0.0}, "beta must be > 0"),
    ({"level_fraction": 0.0}, "level_fraction must be > 0"),
    ({"level_fraction": 1.5}, "level_fraction must be <= 1"),
    ({"adv_clip_max": None}, "adv_clip_max is DiffusionNFT's A_max"),
    ({"decay_type": 3}, "decay_type"),
    ({"solver": "euler"}, "solver"),
    ({"flow_shift": 0.0}, "flow_shift must be >= 0.01"),
])
def test_config_refuses_bad_options(options, message):
    with pytest.raises(ConfigError, match=message):
        algo_config(DiffusionNFTConfig, **options)
