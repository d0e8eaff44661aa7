"""The sampler step against an independent transcription of the paper's formulas; inputs it cannot take are refused
(property tests: finite outputs over the valid domain, a ValueError, never a silent inf / NaN, outside it)."""

import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from mmgrpo.samplers.flow_sde import entropy_merge_span, flow_sde_std, flow_sde_step


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


# ------------------------------------------------------------------------ inputs the step refuses (property tests)
PROPERTY = settings(derandomize=True, max_examples=100, deadline=None)


def _latents(seed: int, scale: float):
    g = torch.Generator().manual_seed(seed)
    return scale * torch.randn(2, 3, 4, generator=g), scale * torch.randn(2, 3, 4, generator=g)


def _finite(out) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in (out.prev_sample, out.log_prob, out.mean, out.std))


@st.composite
def valid_steps(draw):
    """Steps of every type inside the documented domain: 0 <= sigma_next < sigma <= 1, noise 0 or in [1e-3, 1]."""
    sigma = draw(st.one_of(st.just(1.0), st.floats(1e-3, 1.0)))
    sigma_next = sigma * draw(st.one_of(st.just(0.0), st.floats(0.0, 0.999)))
    return dict(sigma=sigma, sigma_next=sigma_next, sde_type=draw(st.sampled_from(["sde", "cps", "ode"])),
                noise_level=draw(st.one_of(st.just(0.0), st.floats(1e-3, 1.0))),
                sigma_at_one=draw(st.floats(0.05, 0.99)))


@PROPERTY
@given(step=valid_steps(), seed=st.integers(0, 2**16), scale=st.floats(1e-3, 1e2))
def test_valid_steps_give_finite_samples_and_log_probs(step, seed, scale):
    v, x = _latents(seed, scale)
    out = flow_sde_step(v, x, generator=torch.Generator().manual_seed(seed), **step)
    again = flow_sde_step(v, x, prev_sample=out.prev_sample, **step)  # re-scoring what was sampled
    assert _finite(out) and _finite(again)
    assert bool((out.std >= 0).all())
    std = flow_sde_std(step["sigma"], step["sigma_next"], noise_level=step["noise_level"], sde_type=step["sde_type"],
                       sigma_at_one=step["sigma_at_one"])
    assert bool(torch.isfinite(std)) and float(std) >= 0


ANY_FLOAT = st.one_of(st.floats(-0.5, 1.5), st.sampled_from([0.0, 1.0, float("nan"), float("inf"), -float("inf")]))


@PROPERTY
@given(sigma=ANY_FLOAT, sigma_next=ANY_FLOAT, noise_level=st.one_of(st.floats(-1.0, 3.0), ANY_FLOAT),
       sde_type=st.sampled_from(["sde", "cps", "ode"]), sigma_at_one=st.one_of(st.none(), ANY_FLOAT),
       seed=st.integers(0, 2**16))
def test_any_step_is_refused_or_finite(sigma, sigma_next, noise_level, sde_type, sigma_at_one, seed):
    """Over arbitrary (also invalid) sigmas and noise levels the step either raises ValueError or is finite: never a
    silent inf / NaN."""
    v, x = _latents(seed, 1.0)
    try:
        out = flow_sde_step(v, x, sigma, sigma_next, noise_level=noise_level, sde_type=sde_type,
                            sigma_at_one=sigma_at_one, generator=torch.Generator().manual_seed(seed))
    except ValueError:
        return
    assert _finite(out)


@pytest.mark.parametrize("kwargs,match", [
    (dict(sigma=1.0, sigma_next=0.9), "sigma_at_one"),  # Flow-GRPO's 1 - sigma divides by zero at 1
    (dict(sigma=1.0, sigma_next=0.9, sigma_at_one=1.0), "sigma_at_one"),
    (dict(sigma=0.5, sigma_next=0.6), "exceeds sigma"),  # a rising (non-monotone) schedule: sqrt(-dt) is NaN
    (dict(sigma=0.5, sigma_next=0.5), "sigma_next < sigma"),  # zero-length stochastic step: std 0 in the density
    (dict(sigma=0.0, sigma_next=0.0), "sigma_next < sigma"),
    (dict(sigma=1.2, sigma_next=0.5, sigma_at_one=0.9), "sigma must lie in"),
    (dict(sigma=0.5, sigma_next=-0.1), "sigma_next must lie in"),
    (dict(sigma=float("nan"), sigma_next=0.1), "sigma must lie in"),
    (dict(sigma=0.5, sigma_next=0.4, noise_level=-0.1), "noise_level"),
    (dict(sigma=0.5, sigma_next=0.4, noise_level=float("inf")), "noise_level"),
    (dict(sigma=0.5, sigma_next=0.4, noise_level=1.5, sde_type="cps"), "noise_level of a CPS"),
    (dict(sigma=0.5, sigma_next=0.4, noise_level=1e-30), "too small for a float32 log-density"),
    (dict(sigma=torch.tensor([0.5, 0.3]), sigma_next=torch.tensor([0.4, 0.3])), "sigma_next < sigma"),  # per sample
])
def test_steps_that_would_be_inf_or_nan_are_refused(kwargs, match):
    v, x = _latents(0, 1.0)
    with pytest.raises(ValueError, match=match):
        flow_sde_step(v, x, **{"noise_level": 0.7, **kwargs})


def test_ode_step_accepts_what_the_sde_refuses_when_it_is_well_defined():
    """sigma = 1 without a substitute and a zero-length step are fine for the deterministic step."""
    v, x = _latents(0, 1.0)
    assert _finite(flow_sde_step(v, x, 1.0, 0.9, sde_type="ode"))
    assert torch.equal(flow_sde_step(v, x, 0.0, 0.0, noise_level=0.0).prev_sample, x)


def test_entropy_merge_span_refuses_a_start_without_a_next_sigma():
    sigmas = torch.linspace(1, 0, 5)
    with pytest.raises(ValueError, match="start"):
        entropy_merge_span(sigmas, 4, 0.5, noise_level=0.7, max_span=2)
    with pytest.raises(ValueError, match="max_span"):
        entropy_merge_span(sigmas, 1, 0.5, noise_level=0.7, max_span=0)
