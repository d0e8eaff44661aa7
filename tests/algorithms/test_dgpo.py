"""DGPO: the group-preference loss against an independent computation, its direction and sigmoid weight, the
flow-matching likelihood with group-shared noise, the DPM-Solver rollout, the fast-EMA old model and exact resume."""

import dataclasses
import math

import pytest
import torch

from mmgrpo import checkpoint, config as config_mod
from mmgrpo.algorithms.dgpo import DGPO, DGPOConfig, group_weights
from mmgrpo.samplers.flow_plan import group_noise
from mmgrpo.pipelines.sd3 import SD3Config, SD3Policy
from mmgrpo.components import score_unit
from mmgrpo.trainer import Trainer
from mmgrpo.types import PromptBatch, Score
from mmgrpo.plans import FlowPlan

from builders._runs import dgpo_config
from algorithm_options import algo_config

PROMPTS = ["a red circle", "two blue squares"]


def make_policy(path, num_steps=4):
    return SD3Policy(SD3Config(pretrained=path, resolution=32, num_steps=num_steps, guidance_scale=1.0, lora_rank=4,
                               max_sequence_length=16))


def reference_loss(fm, fm_old, fm_ref, v, v_ref, adv, groups, c):
    """DGPO's loss written out sample by sample (the authors' per-group sum over G members, divided by G)."""
    n, k = fm.shape
    total = 0.0
    for j in range(k):
        for i in range(n):
            members = [m for m in range(n) if groups[m] == groups[i]]
            s_g = sum(adv[m] * c.beta_dpo * (fm[m, j].detach() - fm_ref[m, j]) for m in members) / len(members)
            ratio = math.exp(float(fm_old[i, j] - fm[i, j].detach()))
            clip = ratio > 1 + c.clip.high if adv[i] > 0 else ratio < 1 - c.clip.clip_low
            used = fm[i, j].detach() if (clip and c.clip_dsm) else fm[i, j]
            total = total + torch.sigmoid(s_g) * adv[i] * used
    kl = ((v - v_ref) ** 2).mean()
    return total / (n * k) + c.kl.kl_beta * kl


def test_loss_equals_an_independent_computation():
    g = torch.Generator().manual_seed(0)
    n, k = 6, 2
    groups = torch.tensor([3, 3, 3, 8, 8, 8])
    adv = torch.tensor([1.2, -0.4, -0.8, 0.5, 0.5, -1.0])
    fm = (1 + 0.1 * torch.rand(n, k, generator=g)).requires_grad_(True)
    fm_old = fm.detach() + 0.02 * torch.randn(n, k, generator=g)  # some ratios leave [1 - c, 1 + c]
    fm_ref = fm.detach() + 0.01 * torch.randn(n, k, generator=g)
    v = torch.randn(n, k, 3, 2, 2, generator=g, requires_grad=True)
    v_ref = v.detach() + 0.1 * torch.randn(n, k, 3, 2, 2, generator=g)
    c = algo_config(DGPOConfig, beta_dpo=50.0, kl_beta=0.3, clip_low=1e-2)
    out = DGPO(c).loss(Score(log_prob=-fm, velocity=v, group_ids=groups), -fm_old, adv,
                       Score(log_prob=-fm_ref, velocity=v_ref))
    grads = torch.autograd.grad(out.loss, [fm, v])
    expected = reference_loss(fm, fm_old, fm_ref, v, v_ref, adv, groups, c)
    expected_grads = torch.autograd.grad(expected, [fm, v])
    assert out.loss.item() == pytest.approx(expected.item(), rel=1e-5)
    for a, b in zip(grads, expected_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    assert 0 < out.metrics["clip_frac"] < 1  # the check covers clipped and unclipped samples


def test_sigmoid_weight_falls_as_the_preference_is_satisfied():
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0])[:, None]  # [4, 1]
    fm_ref = torch.ones(4, 1)
    weights = []
    for t in torch.linspace(0, 0.05, 6):
        fm = fm_ref - t * adv  # winners' loss falls below the reference, losers' rises above
        weights.append(group_weights(adv * 100.0 * (fm - fm_ref), torch.zeros(4, dtype=torch.long))[0, 0].item())
    assert weights[0] == pytest.approx(0.5)
    assert all(a > b for a, b in zip(weights, weights[1:])) and weights[-1] < 0.01


def test_gradient_lowers_winners_and_raises_losers_loss():
    """A hand-built group whose samples have independent parameters: one gradient step on the DGPO loss."""
    theta = torch.zeros(4, requires_grad=True)
    target = torch.tensor([1.0, -1.0, 2.0, 0.5])
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])
    algorithm = DGPO(algo_config(DGPOConfig, kl_beta=0.0, clip_dsm=False))

    def fm():
        return ((theta - target) ** 2)[:, None]  # [4, 1] per-sample flow-matching loss

    before = fm().detach()
    out = algorithm.loss(Score(log_prob=-fm(), group_ids=torch.zeros(4, dtype=torch.long)), -before, adv,
                         Score(log_prob=-before))
    out.loss.backward()
    with torch.no_grad():
        theta -= 0.1 * theta.grad
    change = (fm().detach() - before).flatten()
    assert (change[adv > 0] < 0).all() and (change[adv < 0] > 0).all()


def test_gradient_step_on_the_tiny_policy_favours_the_winners(tiny_sd3_dir):
    """On real diffusers classes the samples share weights, so one sample's loss may move with another's; what a
    gradient step guarantees is that the winners' flow-matching loss falls relative to the losers'."""
    policy = make_policy(tiny_sd3_dir)
    algorithm = DGPO(algo_config(DGPOConfig, trunc_steps=2, num_train_timesteps=1, kl_beta=0.0))
    plan = algorithm.schedule(4, torch.Generator().manual_seed(0))
    rollout = policy.sample(PromptBatch(PROMPTS[:1]).repeat(4), plan, generator=torch.Generator().manual_seed(0))
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0])
    new, old, ref = score_unit(policy, algorithm, rollout, plan.train_units[0], torch.device("cpu"))
    algorithm.loss(new, old, adv, ref).loss.backward()
    torch.optim.SGD(policy.trainable_parameters(), lr=1.0).step()
    with torch.no_grad():
        change = -policy.likelihood(rollout, plan.train_units[0]).log_prob.flatten() + new.log_prob.flatten()
    assert (adv * change).sum() < 0
    assert change[adv > 0].mean() < 0 < change[adv < 0].mean()


def test_clip_detaches_samples_beyond_the_ratio_range():
    fm = torch.ones(4, 1, requires_grad=True)
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0])
    # ratio exp(L_old - L): [1.05, 1.0, 0.95, 1.0] with c = 1e-2 -> samples 0 (A > 0, too high), 2 (A < 0, too low)
    fm_old = torch.tensor([[1 + math.log(1.05)], [1.0], [1 + math.log(0.95)], [1.0]])
    out = DGPO(algo_config(DGPOConfig, kl_beta=0.0)).loss(Score(log_prob=-fm, group_ids=torch.zeros(4, dtype=torch.long)),
                                             -fm_old, adv, Score(log_prob=-torch.ones(4, 1)))
    (grad,) = torch.autograd.grad(out.loss, fm)
    assert grad.flatten().ne(0).tolist() == [False, True, False, True]
    assert out.metrics["clip_frac"] == 0.5


def test_likelihood_is_the_flow_matching_loss_with_group_shared_noise(tiny_sd3_dir):
    policy = make_policy(tiny_sd3_dir)
    algorithm = DGPO(algo_config(DGPOConfig, trunc_steps=2, num_train_timesteps=2))
    plan = algorithm.schedule(4, torch.Generator().manual_seed(0))
    batch = PromptBatch(PROMPTS).repeat(3)
    rollout = policy.sample(batch, plan, generator=torch.Generator().manual_seed(1))
    assert torch.equal(rollout.old_log_probs, torch.zeros(6, 4))  # deterministic rollout: nothing to replay
    j = plan.train_units[0][0]
    with torch.no_grad():
        got = policy.likelihood(rollout, [j])
    eps = group_noise(policy._noise, rollout.group_ids, plan.seed, salt=j)  # [6, C, h, w]
    assert torch.equal(eps[0], eps[2]) and not torch.equal(eps[0], eps[3])  # shared within a group only
    x0, s = rollout.trajectory["latents"][:, -1], rollout.trajectory["shared_sigmas"][j]
    embeds = {k: rollout.trajectory[k] for k in ("prompt_embeds", "pooled")}
    with torch.no_grad():
        v = policy.velocity((1 - s) * x0 + s * eps, s, embeds, guidance=False)
    expected = -((v - (eps - x0)) ** 2).mean(dim=(1, 2, 3))
    torch.testing.assert_close(got.log_prob[:, 0], expected, rtol=1e-5, atol=1e-6)
    # the same values when the batch is split over two processes (a group spanning them keeps its noise)
    halves = [rollout.select(torch.arange(k, k + 3)) for k in (0, 3)]
    with torch.no_grad():
        split = torch.cat([policy.likelihood(h, [j]).log_prob for h in halves])
    torch.testing.assert_close(split, got.log_prob, rtol=1e-5, atol=1e-6)


def test_rollout_is_diffusers_dpm_solver(tiny_sd3_dir):
    from diffusers import DPMSolverMultistepScheduler

    policy = make_policy(tiny_sd3_dir)
    plan = DGPO(algo_config(DGPOConfig, trunc_steps=2, num_train_timesteps=1, flow_shift=3.0)).schedule(4)
    batch = PromptBatch(PROMPTS)
    rollout = policy.sample(batch, plan, generator=torch.Generator().manual_seed(3))
    scheduler = DPMSolverMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0,
                                            solver_order=2, algorithm_type="dpmsolver++", final_sigmas_type="zero")
    scheduler.set_timesteps(4)
    x = torch.randn(2, 4, 16, 16, generator=torch.Generator().manual_seed(3))
    embeds = policy.encode(PROMPTS)
    with torch.no_grad():
        for i, t in enumerate(scheduler.timesteps):
            x = scheduler.step(policy.velocity(x, scheduler.sigmas[i], embeds), t, x).prev_sample
    torch.testing.assert_close(rollout.trajectory["latents"][:, -1], x, rtol=1e-5, atol=1e-5)
    assert rollout.trajectory["shared_sigmas"][0] > 0.99 and rollout.trajectory["shared_sigmas"][-1] == 0


def test_flow_rollout_is_the_evaluation_sampler(tiny_sd3_dir):
    """``solver: flow`` (FlowPlan's word; mmgrpo's variant, the authors have no such option) samples with the
    pipeline's own Euler ODE, the evaluation's sampler; the former name ``euler`` is refused naming it."""
    policy = make_policy(tiny_sd3_dir)
    plan = DGPO(algo_config(DGPOConfig, trunc_steps=2, num_train_timesteps=2, solver="flow")).schedule(4)
    batch = PromptBatch(PROMPTS)
    rollout = policy.sample(batch, plan, generator=torch.Generator().manual_seed(3))
    evaluated = policy.sample(batch, FlowPlan.deterministic(4), generator=torch.Generator().manual_seed(3))
    assert torch.equal(rollout.trajectory["latents"][:, -1], evaluated.trajectory["latents"][:, -1])
    # its likelihood is scored at the Euler noise levels of the high-noise end
    assert plan.solver == "flow" and {j for unit in plan.train_units for j in unit} <= {0, 1, 2}
    with pytest.raises(ValueError, match=r"^algorithm\.solver must be 'dpm' or 'flow', got 'heun'"):
        algo_config(DGPOConfig, solver="heun")
    with pytest.raises(ValueError, match=r"^algorithm\.solver: 'euler' was renamed: use 'flow' \(FlowPlan"):
        algo_config(DGPOConfig, solver="euler")


def test_fast_ema_old_model(tiny_sd3_dir):
    policy = make_policy(tiny_sd3_dir)
    algorithm = DGPO(algo_config(DGPOConfig, ema_decay_rate=0.1, ema_decay_max=0.3))
    params = policy.trainable_parameters()
    start = [p.detach().clone() for p in params]
    algorithm.after_update(policy)  # update 0: decay 0, the old model is the current one
    assert all(torch.equal(s, p) for s, p in zip(algorithm.ema.shadow, params))
    for step in (1, 2, 3, 4):
        previous = [s.clone() for s in algorithm.ema.shadow]
        with torch.no_grad():
            for p in params:
                p.add_(0.1)
        algorithm.after_update(policy)
        decay = min(0.3, 0.1 * step)
        for s, old, p in zip(algorithm.ema.shadow, previous, params):
            torch.testing.assert_close(s, decay * old + (1 - decay) * p.detach(), rtol=1e-6, atol=1e-7)
    current = [p.detach().clone() for p in params]
    with algorithm.old_policy(policy):
        assert all(torch.equal(p, s) for p, s in zip(params, algorithm.ema.shadow))
    assert all(torch.equal(p, c) for p, c in zip(params, current))  # restored bit for bit
    state = algorithm.state_dict()
    fresh = DGPO(DGPOConfig())
    fresh.load_state_dict(state)
    assert fresh.updates == 5 and all(torch.equal(a, b) for a, b in zip(fresh.ema.shadow, algorithm.ema.shadow))
    assert not torch.equal(start[0], current[0])


def test_old_model_scores_under_the_ema_weights(tiny_sd3_dir):
    policy = make_policy(tiny_sd3_dir)
    algorithm = DGPO(algo_config(DGPOConfig, trunc_steps=2, num_train_timesteps=1))
    plan = algorithm.schedule(4, torch.Generator().manual_seed(0))
    rollout = policy.sample(PromptBatch(PROMPTS).repeat(2), plan, generator=torch.Generator().manual_seed(0))
    unit = plan.train_units[0]
    _, old, _ = score_unit(policy, algorithm, rollout, unit, torch.device("cpu"))
    with torch.no_grad():
        for p in policy.trainable_parameters():
            p.add_(0.05 * torch.randn_like(p))
    new, old_after, _ = score_unit(policy, algorithm, rollout, unit, torch.device("cpu"))
    torch.testing.assert_close(old_after, old, rtol=0, atol=0)  # the EMA has not moved: no update yet
    assert not torch.allclose(new.log_prob.detach(), old)


def test_the_old_log_probs_are_the_ones_the_traits_declare(tiny_sd3_dir):
    """One meaning of "old" per algorithm, declared: the same DGPO, whose fast-EMA old model differs from the current
    weights, gets the rollout's record, its old model's score or the detached current score exactly as
    ``traits.old_source`` says, whatever members it has."""
    policy = make_policy(tiny_sd3_dir)
    algorithm = DGPO(algo_config(DGPOConfig, trunc_steps=2, num_train_timesteps=1, kl_beta=0.0))
    plan = algorithm.schedule(4, torch.Generator().manual_seed(0))
    rollout = policy.sample(PromptBatch(PROMPTS).repeat(2), plan, generator=torch.Generator().manual_seed(0))
    unit = plan.train_units[0]
    algorithm.after_update(policy)  # decay 0: the old model is the current weights...
    with torch.no_grad():
        for p in policy.trainable_parameters():
            p.add_(0.05 * torch.randn_like(p))  # ...which then move
    with torch.no_grad(), algorithm.old_policy(policy):
        under_ema = policy.likelihood(rollout, unit).log_prob  # [n, 1]
    olds = {}
    for source in ("rollout", "old_model", "current"):
        algorithm.traits = dataclasses.replace(algorithm.traits, old_source=source)
        new, olds[source], _ = score_unit(policy, algorithm, rollout, unit, torch.device("cpu"))
        assert olds[source].shape == new.log_prob.shape == (4, 1)
    torch.testing.assert_close(olds["rollout"], rollout.old_log_probs[:, unit], rtol=0, atol=0)
    torch.testing.assert_close(olds["old_model"], under_ema, rtol=0, atol=0)
    torch.testing.assert_close(olds["current"], new.log_prob.detach(), rtol=0, atol=0)
    assert not torch.allclose(olds["old_model"], olds["current"])
    assert not torch.allclose(olds["rollout"], olds["current"])


def test_without_clip_the_old_model_is_not_scored(tiny_sd3_dir):
    """clip_dsm and clip_kl off (and no use_ema_ref): the clip detaches nothing, so nothing reads the old model, its
    forward pass is skipped, the old score is the detached new one and the loss equals the clipped loss of a batch in
    which nothing is clipped."""
    policy = make_policy(tiny_sd3_dir)
    algorithm = DGPO(algo_config(DGPOConfig, trunc_steps=2, num_train_timesteps=1, clip_dsm=False, kl_beta=0.0))
    assert algorithm.traits.old_source == "current" and algorithm.traits.needs_reference
    plan = algorithm.schedule(4, torch.Generator().manual_seed(0))
    rollout = policy.sample(PromptBatch(PROMPTS).repeat(2), plan, generator=torch.Generator().manual_seed(0))
    calls = []
    likelihood = policy.likelihood
    policy.likelihood = lambda *args: calls.append(1) or likelihood(*args)
    new, old, ref = score_unit(policy, algorithm, rollout, plan.train_units[0], torch.device("cpu"))
    assert len(calls) == 2  # the policy and the frozen reference; no old model
    torch.testing.assert_close(old, new.log_prob.detach(), rtol=0, atol=0)
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5])
    unclipped = algorithm.loss(new, old, advantages, ref)
    far_old = old - 5.0  # ratios exp(-5): every positive-advantage sample would be clipped at any clip_low > 0
    out = algorithm.loss(new, far_old, advantages, ref)
    assert out.metrics["clip_frac"] == 0.0
    torch.testing.assert_close(out.loss, unclipped.loss, rtol=0, atol=0)
    clipping = DGPO(algo_config(DGPOConfig, trunc_steps=2, num_train_timesteps=1, clip_low=1e-2, kl_beta=0.0))
    assert clipping.loss(new, far_old, advantages, ref).metrics["clip_frac"] > 0
    algorithm.after_update(policy)
    assert algorithm.ema.shadow is None and algorithm.updates == 1  # no EMA is kept


def test_resume_restores_the_old_model_exactly(tmp_path, tiny_sd3_dir):
    full = Trainer(config_mod.from_dict(dgpo_config(tmp_path / "a", tiny_sd3_dir, 4)))
    full.train()
    raw = dgpo_config(tmp_path / "b", tiny_sd3_dir, 2)
    Trainer(config_mod.from_dict(raw)).train()
    raw["train"]["max_steps"] = 4
    raw["checkpoint"]["resume_from"] = "latest"
    resumed = Trainer(config_mod.from_dict(raw))
    assert resumed.algorithm.updates == 2 and resumed.algorithm.ema.shadow is not None
    resumed.train()
    assert full.algorithm.updates == resumed.algorithm.updates == 4
    for a, b in zip(full.policy.trainable_parameters(), resumed.policy.trainable_parameters()):
        assert torch.equal(a, b)
    for a, b in zip(full.algorithm.ema.shadow, resumed.algorithm.ema.shadow):
        assert torch.equal(a, b)


def test_groups_without_signal_are_not_scored_and_the_gradient_is_unchanged(tmp_path, tiny_sd3_dir):
    """With kl_beta 0 a zero-advantage group adds nothing to DGPO's gradient, so the trainer skips scoring it; the
    gradient of the update equals the one that scores every sample."""
    raw = dgpo_config(tmp_path, tiny_sd3_dir, 1)
    raw["algorithm"].update(kl_beta=0.0, clip_dsm=False)
    raw["train"].update(prompts_per_step=3, minibatch_size=4)  # 6 samples: minibatches of 4 and 2
    trainer = Trainer(config_mod.from_dict(raw))
    assert trainer.algorithm.traits.zero_advantage_is_inert
    plan = trainer.algorithm.schedule(trainer.policy.num_steps, torch.Generator().manual_seed(0))
    batch = PromptBatch(["a red circle", "a blue square", "a green triangle"]).repeat(2)
    rollout = trainer.policy.sample(batch, plan, generator=torch.Generator().manual_seed(0))
    advantages = torch.tensor([0.0, 0.0, 1.0, -1.0, 0.5, -0.5])  # group 0 has no signal
    with_signal = torch.tensor([False, False, True, True, True, True])
    state = {k: v.clone() for k, v in trainer.policy.transformer.state_dict().items()}
    scored, grads = [], []
    likelihood = trainer.policy.likelihood
    trainer.policy.likelihood = lambda sub, unit: scored.extend(sub.group_ids.tolist()) or likelihood(sub, unit)
    step = trainer.optimizer.step
    trainer.optimizer.step = lambda: grads.append([p.grad.clone() for p in trainer.policy.trainable_parameters()])
    runs = []
    for inert in (True, False):
        trainer.algorithm.traits = dataclasses.replace(trainer.algorithm.traits, zero_advantage_is_inert=inert)
        scored.clear(), grads.clear()
        metrics = trainer.update(rollout, plan, advantages, with_signal, torch.Generator().manual_seed(1))
        trainer.optimizer.zero_grad(set_to_none=True)
        runs.append((list(scored), grads[0], metrics))
    trainer.optimizer.step = step
    (scored_inert, grads_inert, metrics_inert), (scored_all, grads_all, _) = runs
    assert 0 not in scored_inert and 0 in scored_all  # group 0 was never scored when inert
    assert metrics_inert["train/unscored_share"] == pytest.approx(2 / 6)
    assert any(torch.count_nonzero(g) for g in grads_all)
    for a, b in zip(grads_inert, grads_all):  # equal up to float summation order (2 threads sum differently)
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * float(b.abs().max()) + 1e-12)
    assert all(torch.equal(v, trainer.policy.transformer.state_dict()[k]) for k, v in state.items())  # no step taken


def test_the_trainer_and_checkpoints_follow_the_declared_traits(tmp_path, tiny_sd3_dir):
    """Optional members are declared, not probed: DGPO has `after_update` and `state_dict`, but once its traits say
    it has neither, the trainer does not call the hook and a checkpoint holds no algorithm state."""
    trainer = Trainer(config_mod.from_dict(dgpo_config(tmp_path, tiny_sd3_dir, 1)))
    assert trainer.algorithm.traits.after_update and trainer.algorithm.traits.has_state
    trainer.algorithm.traits = dataclasses.replace(trainer.algorithm.traits, after_update=False, has_state=False)
    assert trainer.train_step()["train/skipped_updates"] == 0  # an update was taken...
    assert trainer.algorithm.updates == 0  # ...and the hook not called
    saved = trainer.save()
    assert not (saved / checkpoint.ALGORITHM_FILE).exists() and (saved / checkpoint.OPTIMIZER_FILE).exists()
