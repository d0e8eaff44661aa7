"""The sampler step against an independent transcription of the paper's formulas."""

import math

import pytest
import torch

from mmgrpo.samplers.flow_sde import flow_sde_step


def paper_sde_step(x, v, sigma, sigma_next, eta, sigma_one, prev):
    """Flow-GRPO (arXiv 2505.05470, eq. 9-10), element by element in float64, written from the paper."""
    dt = sigma_next - sigma
    denom_sigma = sigma_one if sigma == 1 else sigma
    sig_t = eta * math.sqrt(sigma / (1 - denom_sigma))
    mean = x + (v + sig_t**2 / (2 * sigma) * (x + (1 - sigma) * v)) * dt
    std = sig_t * math.sqrt(-dt)
    logp = -((prev - mean) ** 2) / (2 * std**2) - math.log(std) - 0.5 * math.log(2 * math.pi)
    return mean, std, logp.mean(dim=tuple(range(1, x.dim())))


@pytest.mark.parametrize("sigma,sigma_next", [(1.0, 0.9), (0.7, 0.55), (0.3, 0.0)])
def test_sde_step_matches_paper(sigma, sigma_next):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 4, 5, 5, generator=g)
    v = torch.randn(3, 4, 5, 5, generator=g)
    out = flow_sde_step(v, x, sigma, sigma_next, noise_level=0.7, sigma_at_one=0.9, generator=g)
    mean, std, logp = paper_sde_step(x.double(), v.double(), sigma, sigma_next, 0.7, 0.9, out.prev_sample.double())
    torch.testing.assert_close(out.mean.double(), mean, rtol=1e-5, atol=1e-5)
    assert out.std.flatten()[0].item() == pytest.approx(std, rel=1e-5)
    torch.testing.assert_close(out.log_prob.double(), logp, rtol=1e-4, atol=1e-4)
    # the sample really is mean + std * N(0, 1): standardised residual has unit variance
    z = (out.prev_sample - out.mean) / out.std
    assert 0.7 < z.std().item() < 1.3


def test_rescoring_given_sample_is_exact_and_differentiable():
    x = torch.randn(2, 4, 3, 3)
    v = torch.randn(2, 4, 3, 3, requires_grad=True)
    first = flow_sde_step(v.detach(), x, 0.8, 0.6, generator=torch.Generator().manual_seed(1))
    again = flow_sde_step(v, x, 0.8, 0.6, prev_sample=first.prev_sample)
    assert torch.equal(first.log_prob, again.log_prob.detach())
    again.log_prob.sum().backward()
    assert v.grad is not None and v.grad.abs().sum() > 0


def test_ode_step_is_euler_and_small_eta_tends_to_it():
    """The ODE step is the Euler step; the SDE step's mean tends to it as eta -> 0."""
    x, v = torch.randn(2, 4, 3, 3), torch.randn(2, 4, 3, 3)
    ode = flow_sde_step(v, x, 0.6, 0.4, sde_type="ode")
    torch.testing.assert_close(ode.prev_sample, x + (0.4 - 0.6) * v)
    assert torch.equal(ode.log_prob, torch.zeros(2))
    tiny_eta = flow_sde_step(v, x, 0.6, 0.4, noise_level=1e-6, noise=torch.zeros_like(x))
    torch.testing.assert_close(tiny_eta.prev_sample, ode.prev_sample, rtol=1e-5, atol=1e-5)


def test_cps_step_matches_formula():
    x, v = torch.randn(2, 4, 3, 3, dtype=torch.float64), torch.randn(2, 4, 3, 3, dtype=torch.float64)
    s, s_next, eta = 0.6, 0.45, 0.8
    out = flow_sde_step(v, x, s, s_next, noise_level=eta, sde_type="cps", generator=torch.Generator().manual_seed(2))
    std = s_next * math.sin(eta * math.pi / 2)
    x0, x1 = x - s * v, x + (1 - s) * v
    mean = (1 - s_next) * x0 + math.sqrt(s_next**2 - std**2) * x1
    torch.testing.assert_close(out.mean.double(), mean, rtol=1e-5, atol=1e-5)
    expected = -((out.prev_sample.double() - mean) ** 2).mean(dim=(1, 2, 3))
    torch.testing.assert_close(out.log_prob.double(), expected, rtol=1e-4, atol=1e-5)


def test_bad_sde_type_is_rejected():
    with pytest.raises(ValueError, match="sde_type"):
        flow_sde_step(torch.zeros(1, 1), torch.zeros(1, 1), 0.5, 0.4, sde_type="euler")
