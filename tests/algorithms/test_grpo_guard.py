"""GRPO-Guard (``ratio_norm``) on the flow algorithms with a per-step ratio: the authors' published rule on the same
tensors, ratio 1 on-policy through the tiny SD3 pipeline, zero advantage -> zero gradient, the option off leaves
today's numbers, and the config checks."""

import dataclasses

import pytest
import torch

from mmgrpo.algorithms.chunk_grpo import ChunkGRPO, ChunkGRPOConfig
from mmgrpo.algorithms.e_grpo import EGRPO, EGRPOConfig
from mmgrpo.algorithms.flow_grpo import FlowGRPO, FlowGRPOConfig
from mmgrpo.losses import ratio_norm
from mmgrpo.pipelines.sd3 import SD3Config, SD3Policy
from mmgrpo.preflight import require_plan
from mmgrpo.types import PromptBatch, Score
from mmgrpo.validation import ConfigError
from algorithm_options import algo_config


def gaussian_case(n=6, shape=(4, 3, 3), sigma_t=0.9, sqrt_dt=0.3, drift=0.05, seed=0):
    """A Gaussian SDE transition sampled from the old mean, scored (element-mean log-density, as Flow-GRPO) under an
    old and a new mean."""
    g = torch.Generator().manual_seed(seed)
    s = sigma_t * sqrt_dt
    old_mean = torch.randn(n, 1, *shape, generator=g)
    mean = old_mean + drift * torch.randn(n, 1, *shape, generator=g)
    eps = torch.randn(n, 1, *shape, generator=g)
    x = old_mean + s * eps

    def log_density(mu):
        return (-((x - mu) ** 2) / (2 * s**2) - torch.log(torch.tensor(s)) - 0.5 * torch.log(torch.tensor(2 * torch.pi)))\
            .flatten(2).mean(-1)

    std = torch.full((n, 1, 1, 1, 1), s)
    score = Score(log_prob=log_density(mean), mean=mean, old_mean=old_mean, std=std,
                  noise_scale=torch.full((n, 1, 1, 1, 1), sigma_t), mask=torch.ones(n, 1, dtype=torch.bool))
    return score, log_density(old_mean), eps


def authors_guard_loss(log_prob, old_log_prob, mean, old_mean, std_dev_t, sqrt_dt, advantages, clip_range):
    """The GRPO-Guard loss of the authors' flow_grpo scripts (and verl-omni's ``grpo_guard``), written out:

        scale = sqrt_dt * sigma_t
        ratio_mean_bias = mean((mu - mu_old)^2) / (2 scale^2)
        ratio = exp((log_prob - old_log_prob + ratio_mean_bias) * scale)
        loss = mean(max(-A ratio, -A clamp(ratio, 1 - clip, 1 + clip))) / sqrt_dt^2
    """
    scale = sqrt_dt * std_dev_t
    bias = (mean - old_mean).pow(2).flatten(1).mean(1) / (2 * scale**2)
    ratio = torch.exp((log_prob - old_log_prob + bias) * scale)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1 - clip_range, 1 + clip_range)
    return torch.mean(torch.maximum(unclipped, clipped)) / sqrt_dt**2, ratio


def test_flow_grpo_guard_loss_is_the_authors_rule():
    score, old_log_prob, _ = gaussian_case()
    advantages = torch.tensor([1.5, -0.7, 0.3, -2.0, 0.9, -0.1])
    algorithm = FlowGRPO(algo_config(FlowGRPOConfig, ratio_norm=True, clip_low=2e-3))
    out = algorithm.loss(score, old_log_prob, advantages)
    expected, ratio = authors_guard_loss(score.log_prob[:, 0], old_log_prob[:, 0], score.mean[:, 0],
                                         score.old_mean[:, 0], 0.9, 0.3, advantages, 2e-3)
    torch.testing.assert_close(out.loss, expected, rtol=1e-5, atol=1e-7)
    assert out.metrics["ratio_mean"] == pytest.approx(ratio.mean().item(), rel=1e-5)
    # both clip sides bind on these tensors: the normalised ratio is centred at 1
    assert bool((ratio > 1 + 2e-3).any()) and bool((ratio < 1 - 2e-3).any())


def test_ratio_norm_equals_flow_factory_form_and_removes_the_mean_shift():
    """Flow-Factory's form, ``exp(s (log pi - log pi_old) + mean(d^2) / (2 s))``, is the same ratio; on exact
    Gaussian log-densities it is ``exp(mean(eps d))``: the negative mean ``-mean(d^2) / (2 s^2)`` of the raw log-ratio
    is gone."""
    score, old_log_prob, eps = gaussian_case(drift=0.2)
    raw = score.log_prob - old_log_prob
    normed, dt = ratio_norm(raw, score.mean, score.old_mean, score.std, score.noise_scale)
    s, d = 0.9 * 0.3, score.mean - score.old_mean
    flow_factory = s * raw + d.pow(2).flatten(2).mean(-1) / (2 * s)
    torch.testing.assert_close(normed, flow_factory, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(normed, (eps * d).flatten(2).mean(-1), rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(dt, torch.full_like(dt, 0.09))


def test_e_grpo_and_chunk_grpo_take_the_normalised_step_ratio():
    score, old_log_prob, _ = gaussian_case()
    advantages = torch.tensor([1.5, -0.7, 0.3, -2.0, 0.9, -0.1])
    expected, _ = authors_guard_loss(score.log_prob[:, 0], old_log_prob[:, 0], score.mean[:, 0],
                                     score.old_mean[:, 0], 0.9, 0.3, advantages, 1e-4)
    e_grpo = EGRPO(algo_config(EGRPOConfig, ratio_norm=True))
    torch.testing.assert_close(e_grpo.loss(score, old_log_prob, advantages).loss, expected, rtol=1e-5, atol=1e-7)
    # a chunk of two steps of different |dt|: the mean of the normalised step log-ratios, divided by the mean |dt|
    other, other_old, _ = gaussian_case(sigma_t=0.6, sqrt_dt=0.5, seed=1)
    chunk = Score(**{f: torch.cat([getattr(score, f), getattr(other, f)], dim=1)
                     for f in ("log_prob", "mean", "old_mean", "std", "noise_scale", "mask")})
    old = torch.cat([old_log_prob, other_old], dim=1)
    normed = [(lp - olp + (m - om).pow(2).flatten(1).mean(1) / (2 * s**2)) * s for lp, olp, m, om, s in
              ((score.log_prob[:, 0], old_log_prob[:, 0], score.mean[:, 0], score.old_mean[:, 0], 0.27),
               (other.log_prob[:, 0], other_old[:, 0], other.mean[:, 0], other.old_mean[:, 0], 0.3))]
    ratio = torch.exp((normed[0] + normed[1]) / 2)
    objective = torch.maximum(-advantages * ratio, -advantages * torch.clamp(ratio, 1 - 5e-5, 1 + 5e-5))
    out = ChunkGRPO(algo_config(ChunkGRPOConfig, ratio_norm=True)).loss(chunk, old, advantages)
    torch.testing.assert_close(out.loss, (objective / ((0.09 + 0.25) / 2)).mean(), rtol=1e-5, atol=1e-7)


def test_the_option_off_gives_plain_flow_grpo_numbers():
    score, old_log_prob, _ = gaussian_case()
    advantages = torch.tensor([1.5, -0.7, 0.3, -2.0, 0.9, -0.1])
    bare = Score(log_prob=score.log_prob)  # off: nothing but log_prob is read
    out = FlowGRPO(algo_config(FlowGRPOConfig, clip_low=2e-3)).loss(bare, old_log_prob, advantages)
    ratio = torch.exp(score.log_prob - old_log_prob)[:, 0]
    plain = torch.maximum(-advantages * ratio, -advantages * torch.clamp(ratio, 1 - 2e-3, 1 + 2e-3)).mean()
    assert torch.equal(out.loss, plain)
    for cls, config in ((FlowGRPO, FlowGRPOConfig), (EGRPO, EGRPOConfig), (ChunkGRPO, ChunkGRPOConfig)):
        off = cls(algo_config(config))
        assert not {"old_mean", "mean"} & off.traits.reads and "old_mean" not in off.schedule(4).features()
        on = cls(algo_config(config, ratio_norm=True))
        assert {"mean", "old_mean", "std", "noise_scale"} <= on.traits.reads
        assert "old_mean" in on.schedule(4, torch.Generator().manual_seed(0)).features()


def make_policy(path, num_steps=4):
    return SD3Policy(SD3Config(pretrained=path, resolution=32, num_steps=num_steps, guidance_scale=1.0, lora_rank=4,
                               max_sequence_length=16))


@pytest.mark.parametrize(("cls", "config", "options"), [
    (FlowGRPO, FlowGRPOConfig, {"sde_window_size": 2}),
    (EGRPO, EGRPOConfig, {"sde_steps": [0, 1]}),
    (ChunkGRPO, ChunkGRPOConfig, {"chunk_size": 2, "timestep_fraction": 1.0}),
])
def test_on_policy_ratio_is_one_and_zero_advantage_gives_zero_gradient(tiny_sd3_dir, cls, config, options):
    policy = make_policy(tiny_sd3_dir)
    algorithm = cls(algo_config(config, ratio_norm=True, **options))
    plan = algorithm.schedule(policy.num_steps, torch.Generator().manual_seed(0))
    batch = PromptBatch(["a red circle", "two blue squares"]).repeat(4)
    rollout = policy.sample(batch, plan, generator=torch.Generator().manual_seed(1))
    assert rollout.trajectory["old_means"].shape[1] == len(set(plan.trained_steps))
    for unit in plan.train_units:
        new = policy.log_prob(rollout, unit)
        old = rollout.old_log_probs[:, unit]
        out = algorithm.loss(new, old, torch.zeros(8))
        assert out.metrics["ratio_mean"] == pytest.approx(1.0, abs=1e-6)
        out.loss.backward()
        assert all(p.grad is None or torch.count_nonzero(p.grad) == 0 for p in policy.trainable_parameters())
        advantages = torch.tensor([1.0, -1.0] * 4)
        algorithm.loss(policy.log_prob(rollout, unit), old, advantages).loss.backward()
        assert any(p.grad is not None and torch.count_nonzero(p.grad) > 0 for p in policy.trainable_parameters())
        for p in policy.trainable_parameters():
            p.grad = None


def test_recording_the_means_leaves_the_rollout_unchanged(tiny_sd3_dir):
    policy = make_policy(tiny_sd3_dir)
    batch = PromptBatch(["a red circle"]).repeat(2)
    rollouts = [policy.sample(batch, FlowGRPO(algo_config(FlowGRPOConfig, ratio_norm=on)).schedule(4),
                              generator=torch.Generator().manual_seed(3)) for on in (False, True)]
    assert torch.equal(rollouts[0].trajectory["latents"], rollouts[1].trajectory["latents"])
    assert torch.equal(rollouts[0].old_log_probs, rollouts[1].old_log_probs)
    assert "old_means" not in rollouts[0].trajectory and policy.log_prob(rollouts[0], [0]).old_mean is None
    with torch.no_grad():
        replay = policy.log_prob(rollouts[1], [1, 2])
    torch.testing.assert_close(replay.old_mean, replay.mean, rtol=0, atol=1e-6)


def test_config_checks():
    with pytest.raises(ConfigError, match="ratio_norm .*sde_type 'cps'"):
        algo_config(FlowGRPOConfig, ratio_norm=True, sde_type="cps")
    with pytest.raises(ConfigError, match="ratio_norm"):
        algo_config(EGRPOConfig, ratio_norm="yes")
    with pytest.raises(ConfigError, match="ratio_norm .*sde_type 'cps'"):
        algo_config(ChunkGRPOConfig, ratio_norm=True, sde_type="cps")
    algo_config(FlowGRPOConfig, ratio_norm=False, sde_type="cps")  # off: CPS as before


def test_an_algorithm_reading_old_mean_without_asking_the_plan_for_it_is_refused(monkeypatch):
    from types import SimpleNamespace

    from mmgrpo import registry

    algorithm = FlowGRPO(algo_config(FlowGRPOConfig, ratio_norm=True))
    plan = algorithm.schedule(4)
    monkeypatch.setattr(algorithm, "schedule", lambda *args: dataclasses.replace(plan, record_mean=False))
    names = SimpleNamespace(algorithm=SimpleNamespace(name="flow_grpo"), pipeline=SimpleNamespace(name="sd3"))
    with pytest.raises(ConfigError, match=r"reads the score field\(s\) \['old_mean'\].*plan"):
        require_plan(registry.get("pipeline", "sd3"), algorithm, 4, names)
