"""DanceGRPO's SDE step (``sde_type="dance"``) against an independent transcription of the authors' ``flux_step``
(XueZeyue/DanceGRPO, ``fastvideo/train_grpo_flux.py``; MixGRPO's ``dance_grpo_step`` is the same step), on the same
tensors, over the authors' shifted schedule; and its declarations (`check_step`, `flow_sde_std`, `SDEOptions`)."""

import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from mmgrpo.algorithms._options import SDEOptions
from mmgrpo.samplers.flow_sde import check_step, entropy_merge_span, flow_sde_std, flow_sde_step


def authors_schedule(steps: int, shift: float) -> torch.Tensor:
    """``sd3_time_shift(shift, linspace(1, 0, steps + 1))``, the sigmas of the authors' scripts."""
    t = torch.linspace(1, 0, steps + 1, dtype=torch.float64)
    return shift * t / (1 + (shift - 1) * t)


def authors_flux_step(v, x, eta, sigmas, index, prev):
    """The authors' ``flux_step(..., grpo=True, sde_solver=True)`` written out in float64: returns the mean, the std
    and the log-probability of `prev` averaged over all but the batch dimension."""
    sigma = float(sigmas[index])
    dsigma = float(sigmas[index + 1]) - sigma
    mean = x + dsigma * v
    x0 = x - sigma * v
    std = eta * math.sqrt(sigma - float(sigmas[index + 1]))
    score = -(x - x0 * (1 - sigma)) / sigma**2
    mean = mean + (-0.5 * eta**2 * score) * dsigma
    log_prob = -((prev - mean) ** 2) / (2 * std**2) - math.log(std) - math.log(math.sqrt(2 * math.pi))
    return mean, std, log_prob.mean(dim=tuple(range(1, x.dim())))


@pytest.mark.parametrize("index", [0, 5, 14, 15])  # sigma = 1 first, the last step lands on 0
def test_dance_step_equals_the_authors_flux_step(index):
    sigmas = authors_schedule(16, 3.0)  # the authors' FLUX script: 16 steps, shift 3, eta 0.3
    g = torch.Generator().manual_seed(index)
    x, v = torch.randn(3, 4, 5, 5, generator=g), torch.randn(3, 4, 5, 5, generator=g)
    noise = torch.randn(3, 4, 5, 5, generator=g)
    out = flow_sde_step(v, x, sigmas[index], sigmas[index + 1], noise_level=0.3, sde_type="dance", noise=noise)
    mean, std, log_prob = authors_flux_step(v.double(), x.double(), 0.3, sigmas, index, out.prev_sample.double())
    torch.testing.assert_close(out.mean.double(), mean, rtol=1e-5, atol=1e-5)
    assert out.std.flatten()[0].item() == pytest.approx(std, rel=1e-6)
    torch.testing.assert_close(out.prev_sample.double(), mean + std * noise.double(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.log_prob.double(), log_prob, rtol=1e-5, atol=1e-5)
    assert torch.all(out.noise_scale == 0.3)  # g(t) = eta: std = eta * sqrt(|dsigma|)
    # re-scoring the stored next latent gives the recorded log-probability, with gradients to the velocity
    v = v.clone().requires_grad_(True)
    again = flow_sde_step(v, x, sigmas[index], sigmas[index + 1], noise_level=0.3, sde_type="dance",
                          prev_sample=out.prev_sample)
    assert torch.equal(again.log_prob.detach(), out.log_prob)
    again.log_prob.sum().backward()
    assert v.grad.abs().sum() > 0


def test_dance_step_is_not_flow_grpos_and_tends_to_the_ode_step():
    """Another SDE than Flow-GRPO's (other mean and std); as eta -> 0 its mean is the Euler step."""
    x, v = torch.randn(2, 4, 3, 3), torch.randn(2, 4, 3, 3)
    dance = flow_sde_step(v, x, 0.6, 0.4, noise_level=0.7, sde_type="dance", noise=torch.zeros_like(x))
    flow = flow_sde_step(v, x, 0.6, 0.4, noise_level=0.7, sde_type="sde", noise=torch.zeros_like(x))
    assert not torch.allclose(dance.mean, flow.mean) and float(dance.std.flatten()[0]) != float(flow.std.flatten()[0])
    tiny = flow_sde_step(v, x, 0.6, 0.4, noise_level=1e-6, sde_type="dance", noise=torch.zeros_like(x))
    torch.testing.assert_close(tiny.prev_sample, x + (0.4 - 0.6) * v, rtol=1e-5, atol=1e-5)


def test_dance_is_accepted_by_the_checks_std_and_options():
    check_step(1.0, 0.9, noise_level=0.3, sde_type="dance")  # no sigma_at_one needed: nothing divides by 1 - sigma
    assert float(flow_sde_std(0.8, 0.6, noise_level=0.3, sde_type="dance")) == pytest.approx(0.3 * math.sqrt(0.2))
    assert SDEOptions(noise_level=0.3, sde_type="dance").sde_type == "dance"
    with pytest.raises(ValueError, match="sde_type"):
        SDEOptions(sde_type="dancing")
    with pytest.raises(ValueError, match="sigma_next < sigma"):
        flow_sde_step(torch.zeros(1, 2), torch.zeros(1, 2), 0.5, 0.5, noise_level=0.3, sde_type="dance")
    with pytest.raises(ValueError, match="too small for a float32"):
        flow_sde_step(torch.zeros(1, 2), torch.ones(1, 2), 0.5, 0.4, noise_level=1e-30, sde_type="dance")
    # E-GRPO's entropy merge reads the same std
    sigmas = authors_schedule(8, 3.0).float()
    assert entropy_merge_span(sigmas, 2, -10.0, noise_level=0.3, sde_type="dance", max_span=3) == 1


@settings(max_examples=60, deadline=None)
@given(sigma=st.floats(1e-3, 1.0), fraction=st.floats(0.0, 0.999), eta=st.floats(0.0, 2.0))
def test_dance_step_is_finite_on_its_domain(sigma, fraction, eta):
    """Any valid step (sigma in (0, 1], sigma_next in [0, sigma), eta >= 0) gives finite outputs, or a ValueError
    naming the underflowing std (never a silent inf / NaN)."""
    sigma_next = sigma * fraction
    x = torch.randn(2, 3, 2, 2, generator=torch.Generator().manual_seed(0))
    v = torch.randn(2, 3, 2, 2, generator=torch.Generator().manual_seed(1))
    try:
        out = flow_sde_step(v, x, sigma, sigma_next, noise_level=eta, sde_type="dance",
                            generator=torch.Generator().manual_seed(2))
    except ValueError as error:
        assert "too small" in str(error)
        return
    assert torch.isfinite(out.prev_sample).all() and torch.isfinite(out.log_prob).all()
