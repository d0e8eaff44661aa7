"""MixGRPO-Flash's rollout (`mmgrpo.samplers.flow_dpm.sample_post_dpm`, feature ``"dpm_post"``): the window is the plain
loop's SDE (same draws, same log-probs, replayed exactly), and the ODE after it equals DPM-Solver++ (2M) written out
below from the DPM-Solver++ paper (arXiv 2211.01095, eq. for the multistep 2nd order update) on the authors'
compressed schedule (Tencent-Hunyuan/MixGRPO ``run_sample_step``: ``sd3_time_shift(shift, linspace(t_{b+1}, 0, K))``,
``K = int(max((S - b) * ratio, 1))``)."""

import math

import pytest
import torch

from mmgrpo.plans import FlowPlan
from mmgrpo.samplers.flow_dpm import post_levels
from mmgrpo.samplers.flow_plan import replay_plan, run_plan
from mmgrpo.samplers.flow_sde import flow_sde_step

SHAPE = (2, 3)


def _shifted(num, shift=3.0):
    t = torch.linspace(1, 0, num + 1, dtype=torch.float64)
    return (shift * t / (1 + (shift - 1) * t)).float()  # the authors' sigma_schedule


def _noise(count, generator):
    return torch.randn(count, *SHAPE, generator=generator)


def _velocity(x, sigma, rows):
    return 0.5 * x * (1 + float(sigma)) + torch.tensor([[0.3, -0.2, 0.1], [0.05, 0.4, -0.3]]) * (1 - float(sigma))


def authors_levels(num, last, ratio, shift=3.0):
    """The authors' rebuilt tail: ``sd3_time_shift(shift, linspace(linspace(1, 0, S + 1)[last + 1], 0, K))``."""
    count = int(max((num - last) * ratio, 1))
    t0 = torch.linspace(1, 0, num + 1, dtype=torch.float64)[last + 1].item()
    t = torch.linspace(t0, 0, count, dtype=torch.float64)
    return shift * t / (1 + (shift - 1) * t)


def dpm_solver_pp(x, levels, velocity, previous=None, solver_type="midpoint"):
    """DPM-Solver++ (2M) for flow matching, float64: ``alpha = 1 - sigma``, ``lambda = log(alpha / sigma)``,
    ``D = x - sigma v``; first order (DDIM) when there is no previous ``D`` and on the step to sigma 0; `previous`:
    ``(sigma, D)`` of the step before the first one."""
    x = x.double()
    for k in range(len(levels) - 1):
        s, t = float(levels[k]), float(levels[k + 1])
        d0 = x - s * velocity(x.float(), torch.tensor(s), None).double()
        alpha_t = 1 - t
        if t == 0:
            x = d0  # the first-order step to sigma 0 lands on x0_hat
        else:
            lam = lambda sigma: math.log((1 - sigma) / sigma)  # noqa: E731
            h = lam(t) - lam(s)
            x_next = (t / s) * x - alpha_t * (math.exp(-h) - 1) * d0
            if previous is not None:
                s_prev, d_prev = previous
                d1 = (d0 - d_prev) / ((lam(s) - lam(s_prev)) / h)
                if solver_type == "midpoint":
                    x_next = x_next - 0.5 * alpha_t * (math.exp(-h) - 1) * d1
                else:
                    x_next = x_next + alpha_t * ((math.exp(-h) - 1) / h + 1) * d1
            x = x_next
        previous = (s, d0)
    return x


@pytest.mark.parametrize(("num", "last", "ratio"), [(25, 3, 0.4), (25, 3, 0.2), (25, 10, 0.4), (10, 2, 0.4),
                                                     (16, 5, 1.0), (12, 7, 0.5)])
def test_compressed_levels_are_the_authors(num, last, ratio):
    expected = authors_levels(num, last, ratio)
    got = post_levels(_shifted(num), last, ratio)
    assert got.shape == expected.shape and torch.allclose(got.double(), expected, atol=1e-6)
    assert got[-1] == 0 and got[0] == _shifted(num)[last + 1]


def test_at_most_one_level_becomes_two():
    """The authors' ``K = 1`` (their tail would stop at ``sigma_{b+1}``) is raised to 2: one step to sigma 0."""
    got = post_levels(_shifted(25), 21, 0.4)  # int(4 * 0.4) = 1
    assert torch.equal(got, torch.tensor([float(_shifted(25)[22]), 0.0]))
    with pytest.raises(ValueError, match="needs an ODE step after"):
        post_levels(_shifted(10), 9, 0.4)


def _plan(sde_type="sde", ratio=0.4, solver_type="midpoint", window=(1, 2), num=10):
    return FlowPlan(num_steps=num, sde_steps=list(window), train_units=[[s] for s in window], noise_level=0.7,
                    sde_type=sde_type, dpm_post_ratio=ratio, dpm_solver_type=solver_type, seed=3)


@pytest.mark.parametrize(("sde_type", "solver_type"), [("sde", "midpoint"), ("sde", "heun"), ("dance", "midpoint"),
                                                       ("cps", "midpoint")])
def test_window_is_the_plain_sde_and_the_rest_is_dpm_solver_pp(sde_type, solver_type):
    num, sigmas, groups = 10, _shifted(10), torch.arange(4)
    plan = _plan(sde_type, solver_type=solver_type)
    flash, log_probs, mask, _ = run_plan(_velocity, _noise, sigmas, plan, groups, None,
                                         torch.Generator().manual_seed(0))
    plain = FlowPlan(num_steps=num, sde_steps=[1, 2], train_units=[[1], [2]], noise_level=0.7, sde_type=sde_type)
    euler, plain_log_probs, _, _ = run_plan(_velocity, _noise, sigmas, plain, groups, None,
                                            torch.Generator().manual_seed(0))
    latents = flash["latents"]  # [4, 11, 2, 3]
    assert latents.shape == euler["latents"].shape
    assert torch.equal(latents[:, :4], euler["latents"][:, :4])  # same draws up to sigma_3
    assert torch.equal(log_probs[:, :3], plain_log_probs[:, :3]) and (log_probs[:, 1:3] != 0).all()
    assert (log_probs[:, [0, *range(3, num)]] == 0).all()
    assert mask[:, [1, 2]].all() and mask.sum() == 8
    levels = authors_levels(num, 2, 0.4)  # 3 levels: 2 DPM steps instead of 7 Euler steps
    assert len(levels) == 3 and torch.allclose(flash["shared_sigmas"][3:5].double(), levels[:2], atol=1e-6)
    x_last = latents[:, 2]  # the last SDE step's input: its x0_hat starts the history (not with DanceGRPO's SDE)
    previous = None
    if sde_type != "dance":
        previous = (float(sigmas[2]), x_last.double() - float(sigmas[2]) * _velocity(x_last, sigmas[2], None).double())
    expected = dpm_solver_pp(latents[:, 3], levels, _velocity, previous, solver_type)
    assert torch.allclose(latents[:, 5].double(), expected, atol=1e-5)
    assert torch.equal(latents[:, -1], latents[:, 5]) and torch.equal(latents[:, 6:], latents[:, 5:6].expand_as(
        latents[:, 6:]))  # the final latent repeated after the DPM part
    assert not torch.allclose(latents[:, -1], euler["latents"][:, -1])  # not the Euler tail


def test_window_replays_exactly_and_plan_checks():
    sigmas, groups = _shifted(10), torch.tensor([0, 0, 1, 1])
    plan = FlowPlan(num_steps=10, sde_steps=[3, 4], train_units=[[3], [4]], noise_level=0.7, dpm_post_ratio=0.2,
                    init_same_noise=True, record_mean=True, seed=3)
    assert plan.features() == {"dpm_post", "init_same_noise", "old_mean"}
    trajectory, log_probs, mask, _ = run_plan(_velocity, _noise, sigmas, plan, groups, None,
                                              torch.Generator().manual_seed(1))
    assert torch.equal(trajectory["latents"][0, 0], trajectory["latents"][1, 0])
    score = replay_plan(_velocity, trajectory, groups, mask, [3, 4], torch.device("cpu"))
    assert torch.allclose(score.log_prob, log_probs[:, [3, 4]], atol=1e-6)
    x, s, s_next = trajectory["latents"][:, 4], sigmas[4], sigmas[5]
    step = flow_sde_step(_velocity(x, s, None), x, s, s_next, noise_level=0.7, sigma_at_one=sigmas[1],
                         prev_sample=trajectory["latents"][:, 5])
    assert torch.allclose(step.log_prob, log_probs[:, 4], atol=1e-6) and torch.allclose(score.old_mean[:, 1], step.mean)
    empty = FlowPlan(num_steps=10, sde_steps=[], train_units=[], dpm_post_ratio=0.4)  # no window: the plain ODE
    ode, *_ = run_plan(_velocity, _noise, sigmas, empty, groups, None, torch.Generator().manual_seed(1))
    plain, *_ = run_plan(_velocity, _noise, sigmas, FlowPlan.deterministic(10), groups, None,
                         torch.Generator().manual_seed(1))
    assert torch.equal(ode["latents"], plain["latents"])
    with pytest.raises(ValueError, match="needs an ODE step after the last SDE step"):
        _plan(window=(7, 8), num=9)
    with pytest.raises(ValueError, match="must be in"):
        _plan(ratio=1.5)
    with pytest.raises(ValueError, match="combines only with"):
        FlowPlan(num_steps=10, sde_steps=[1], train_units=[[1]], merge={1: 2}, dpm_post_ratio=0.4)
