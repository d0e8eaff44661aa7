"""Flow-DPPO: the divergence-masked loss equals UniRL's published rule on the same tensors, ratio 1 on-policy through
the tiny SD3 pipeline, zero advantage -> zero gradient, Flow-GRPO's plan, and the config checks."""

import pytest
import torch

from mmgrpo.algorithms.flow_dppo import FlowDPPO, FlowDPPOConfig
from mmgrpo.algorithms.flow_grpo import FlowGRPO, FlowGRPOConfig
from mmgrpo.pipelines.sd3 import SD3Config, SD3Policy
from mmgrpo.types import PromptBatch, Score
from mmgrpo.validation import ConfigError
from algorithm_options import algo_config


def authors_flowdppo_loss(new_logp, old_logp, new_means, old_means, advantages, sigma_t, kl_mask_threshold):
    """UniRL's ``_flowdppo_kl_adv_loss`` followed by ``loss_per_elem.mean()``, written out (log-probs and advantages
    ``[B, S']``, means ``[B, S', ...]``, ``sigma_t`` broadcastable):

        ratio = exp(new_logp - old_logp)
        kl = mean over latent dims of (new_means - old_means)^2 / (2 sigma_t^2)
        kl_mask = kl < kl_mask_threshold
        removed = (~kl_mask & ratio > 1 & adv > 0) | (~kl_mask & ratio < 1 & adv < 0)
        loss = mean(where(removed, 0, -adv * ratio))
    """
    ratio = torch.exp(new_logp - old_logp)
    kl = ((new_means - old_means) ** 2 / (2 * sigma_t**2)).flatten(2).mean(-1)
    kl_mask = kl < kl_mask_threshold
    removed = ((~kl_mask) & (ratio > 1.0) & (advantages > 0)) | ((~kl_mask) & (ratio < 1.0) & (advantages < 0))
    return torch.where(~removed, -advantages * ratio, torch.zeros(())).mean(), removed


def case(n=8, k=1, seed=0):
    g = torch.Generator().manual_seed(seed)
    old_mean = torch.randn(n, k, 4, 3, 3, generator=g)
    # half the transitions drift well outside 1e-5, half stay inside
    drift = torch.where(torch.arange(n)[:, None, None, None, None] % 2 == 0, torch.tensor(3e-2), torch.tensor(1e-4))
    mean = (old_mean + drift * torch.randn(n, k, 4, 3, 3, generator=g)).requires_grad_(True)
    log_prob = (0.01 * torch.randn(n, k, generator=g)).requires_grad_(True)
    std = torch.full((n, k, 1, 1, 1), 0.2)
    new = Score(log_prob=log_prob, mean=mean, old_mean=old_mean, std=std, mask=torch.ones(n, k, dtype=torch.bool))
    return new, torch.zeros(n, k), torch.tensor([1.0, 1.0, -1.0, -1.0, 0.5, -0.5, 2.0, -2.0])


@pytest.mark.parametrize("add_kl_coefficient", [True, False])
def test_loss_is_unirl_rule(add_kl_coefficient):
    new, old, advantages = case()
    algorithm = FlowDPPO(algo_config(FlowDPPOConfig, add_kl_coefficient=add_kl_coefficient))
    out = algorithm.loss(new, old, advantages)
    sigma = new.std if add_kl_coefficient else torch.ones(())
    adv = advantages[:, None].expand_as(new.log_prob)
    expected, removed = authors_flowdppo_loss(new.log_prob, old, new.mean, new.old_mean, adv, sigma, 1e-5)
    torch.testing.assert_close(out.loss, expected, rtol=1e-6, atol=1e-8)
    assert out.metrics["masked_frac"] == pytest.approx(removed.float().mean().item())
    if add_kl_coefficient:
        assert 0 < removed.sum() < removed.numel()  # the case exercises both branches
    # a removed update gets no gradient; a kept one gets -A r
    grad, = torch.autograd.grad(out.loss, new.log_prob)
    ratio = torch.exp(new.log_prob - old).detach()
    torch.testing.assert_close(grad, torch.where(removed, 0.0, -adv * ratio) / removed.numel())


def test_corrective_updates_are_never_masked():
    new, old, _ = case()
    algorithm = FlowDPPO(algo_config(FlowDPPOConfig))
    # ratios below 1 with positive advantages (and above 1 with negative) move back: never masked
    log_prob = torch.where(torch.arange(8)[:, None] % 4 < 2, -0.05, 0.05) * torch.ones(8, 1)
    advantages = torch.tensor([1.0, 1.0, -1.0, -1.0] * 2)
    out = algorithm.loss(Score(**{**vars(new), "log_prob": log_prob}), old, advantages)
    assert out.metrics["masked_frac"] == 0.0 and out.metrics["kl_mask_frac"] == 0.5


def make_policy(path, num_steps=4):
    return SD3Policy(SD3Config(pretrained=path, resolution=32, num_steps=num_steps, guidance_scale=1.0, lora_rank=4,
                               max_sequence_length=16))


def test_on_policy_ratio_is_one_nothing_masked_and_zero_advantage_gives_zero_gradient(tiny_sd3_dir):
    policy = make_policy(tiny_sd3_dir)
    algorithm = FlowDPPO(algo_config(FlowDPPOConfig, sde_window_size=2))
    plan = algorithm.schedule(policy.num_steps, torch.Generator().manual_seed(0))
    rollout = policy.sample(PromptBatch(["a red circle", "two blue squares"]).repeat(4), plan,
                            generator=torch.Generator().manual_seed(1))
    for unit in plan.train_units:
        out = algorithm.loss(policy.log_prob(rollout, unit), rollout.old_log_probs[:, unit], torch.zeros(8))
        assert out.metrics["ratio_mean"] == pytest.approx(1.0, abs=1e-6)
        assert out.metrics["kl_old_mean"] < 1e-9 and out.metrics["masked_frac"] == 0.0
        out.loss.backward()
        assert all(p.grad is None or torch.count_nonzero(p.grad) == 0 for p in policy.trainable_parameters())
        out = algorithm.loss(policy.log_prob(rollout, unit), rollout.old_log_probs[:, unit],
                             torch.tensor([1.0, -1.0] * 4))
        out.loss.backward()
        assert any(p.grad is not None and torch.count_nonzero(p.grad) > 0 for p in policy.trainable_parameters())
        for p in policy.trainable_parameters():
            p.grad = None


def test_plan_is_flow_grpos_with_the_means_recorded():
    for options in ({}, {"sde_window_size": 3, "sde_window_range": [1, 4]}, {"timestep_fraction": 0.5}):
        dppo = FlowDPPO(algo_config(FlowDPPOConfig, **options)).schedule(10, torch.Generator().manual_seed(5))
        grpo = FlowGRPO(algo_config(FlowGRPOConfig, **options)).schedule(10, torch.Generator().manual_seed(5))
        assert (dppo.sde_steps, dppo.train_units, dppo.noise_level) == (grpo.sde_steps, grpo.train_units, 0.7)
        assert dppo.features() == {"old_mean"} and not grpo.features()
    algorithm = FlowDPPO(algo_config(FlowDPPOConfig))
    assert algorithm.traits.reads == {"log_prob", "mean", "old_mean", "std"} and not algorithm.traits.needs_reference
    assert FlowDPPO(algo_config(FlowDPPOConfig, kl_beta=0.01)).traits.needs_reference


def test_config_checks():
    config = algo_config(FlowDPPOConfig)
    assert (config.kl_mask_threshold, config.add_kl_coefficient, config.kl.kl_beta) == (1e-5, True, 0.0)
    with pytest.raises(ConfigError, match="kl_mask_threshold must be > 0"):
        algo_config(FlowDPPOConfig, kl_mask_threshold=0.0)
    with pytest.raises(ConfigError, match="sde_type 'cps'"):
        algo_config(FlowDPPOConfig, sde_type="cps")
    with pytest.raises(ConfigError, match="clip_low"):
        algo_config(FlowDPPOConfig, clip_low=0.2)  # no ratio clip
    with pytest.raises(ValueError, match="sde_window_range"):
        algo_config(FlowDPPOConfig, sde_window_range=[3])
