"""One step of a rectified-flow sampler as a stochastic policy: the Flow-GRPO SDE step, its CPS variant, DanceGRPO's
SDE step and the deterministic ODE (Euler) step, each with the log-probability of the transition it takes.

Flow-GRPO: https://arxiv.org/abs/2505.05470 ; coefficients-preserving sampling (CPS): https://arxiv.org/abs/2509.05952 ;
DanceGRPO: https://arxiv.org/abs/2505.07818 (its ``flux_step``, also MixGRPO's Dance-SDE)

Convention: sigmas fall from 1 (noise) to 0 (data); ``x_sigma = (1 - sigma) * x0 + sigma * noise``; the model
predicts the velocity ``v = noise - x0``; a step goes from ``sigma`` to ``sigma_next < sigma``.
All math runs in float32 whatever the input dtype.

Inputs a step cannot take without an inf or NaN are refused with a `ValueError` naming the argument (see
[`check_step`]): sigmas outside ``[0, 1]`` or rising, a stochastic step of zero length, a negative noise level, ``"sde"``
at ``sigma == 1`` without `sigma_at_one`, or an SDE transition whose standard deviation underflows float32. Finite
latents and velocities then give finite outputs and log-probabilities.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

SDE_TYPES = ("sde", "cps", "dance", "ode")


@dataclass
class FlowStepOutput:
    """Result of one sampler step.

    Args:
        prev_sample (`torch.FloatTensor` of shape `[N, ...]`): the next latent (sampled, or the given one).
        log_prob (`torch.FloatTensor` of shape `[N]`): log-density of `prev_sample`, averaged over latent elements
            (zero for the ODE step, which is deterministic).
        mean (`torch.FloatTensor` of shape `[N, ...]`): mean of the transition.
        std (`torch.FloatTensor` of shape `[N, 1, ...]`): standard deviation of the transition (broadcastable).
        noise_scale (`torch.FloatTensor` of shape `[N, 1, ...]`): the SDE's noise scale at the step, Flow-GRPO's
            ``std_dev_t``: ``sigma_t = eta * sqrt(sigma / (1 - sigma))`` for ``"sde"`` (so ``std = sigma_t *
            sqrt(|dt|)``), ``eta`` for ``"dance"`` (``std = eta * sqrt(|dt|)``), the transition std itself for
            ``"cps"``, 0 for a deterministic step.
    """

    prev_sample: torch.Tensor
    log_prob: torch.Tensor
    mean: torch.Tensor
    std: torch.Tensor
    noise_scale: torch.Tensor


def _as_batch(value, like: torch.Tensor) -> torch.Tensor:
    """A float or a `[N]` tensor -> float32 tensor broadcastable to `like` (`[N, 1, 1, ...]`)."""
    value = torch.as_tensor(value, dtype=torch.float32, device=like.device)
    if value.dim() == 0:
        value = value.expand(like.shape[0])
    return value.reshape(-1, *([1] * (like.dim() - 1)))


def check_step(
    sigma: float | torch.Tensor,
    sigma_next: float | torch.Tensor,
    *,
    noise_level: float,
    sde_type: str,
    sigma_at_one: float | torch.Tensor | None = None,
) -> None:
    """Refuses a step that [`flow_sde_step`] cannot take without an inf or NaN.

    Raises:
        `ValueError` naming the argument and the fix: unknown `sde_type`; `noise_level` negative or not finite (above 1
        for ``"cps"``, whose std is ``sigma_next * sin(noise_level * pi / 2)``); a sigma outside ``[0, 1]`` or not
        finite; ``sigma_next > sigma``; ``sigma_next == sigma`` on a stochastic step (a zero-length transition has no
        density); ``"sde"`` at ``sigma == 1`` without `sigma_at_one` in ``(0, 1)`` (``1 - sigma`` divides).
    """
    if sde_type not in SDE_TYPES:
        raise ValueError(f"sde_type must be one of {SDE_TYPES}, got {sde_type!r}.")
    eta = float(noise_level)
    if not (math.isfinite(eta) and eta >= 0):
        raise ValueError(f"noise_level must be a finite number >= 0 (0: the deterministic ODE step), got {eta}.")
    if sde_type == "cps" and eta > 1:
        raise ValueError(f"noise_level of a CPS step must be in [0, 1] (its std is sigma_next * sin(eta pi / 2)), got {eta}.")
    s = torch.as_tensor(sigma, dtype=torch.float32).detach().cpu()
    s_next = torch.as_tensor(sigma_next, dtype=torch.float32).detach().cpu()
    for name, value in (("sigma", s), ("sigma_next", s_next)):
        if not bool(((value >= 0) & (value <= 1)).all()):  # NaN fails too
            raise ValueError(f"{name} must lie in [0, 1] (1: noise, 0: data), got {value.tolist()}.")
    if bool((s_next > s).any()):
        raise ValueError(
            f"sigma_next {s_next.tolist()} exceeds sigma {s.tolist()}: sigmas must fall from 1 (noise) to 0 (data); "
            "pass the schedule in decreasing order."
        )
    if sde_type == "ode" or eta == 0:
        return
    if bool((s_next == s).any()):
        raise ValueError(
            f"a stochastic step needs sigma_next < sigma (a zero-length transition has no density), got sigma "
            f"{s.tolist()} -> {s_next.tolist()}: drop the repeated sigma, or use noise_level 0 for this step."
        )
    if sde_type == "sde" and bool((s == 1).any()):
        one = None if sigma_at_one is None else torch.as_tensor(sigma_at_one, dtype=torch.float32).detach().cpu()
        if one is None or not bool(((one > 0) & (one < 1)).all()):
            raise ValueError(
                f"the SDE step at sigma = 1 divides by 1 - sigma: pass sigma_at_one in (0, 1) (Flow-GRPO uses the "
                f"schedule's second sigma, sigmas[1]), got {None if one is None else one.tolist()}."
            )


def dance_step_mean(x: torch.Tensor, v: torch.Tensor, s: torch.Tensor, s_next: torch.Tensor,
                    noise_level: float) -> torch.Tensor:
    """The mean of DanceGRPO's SDE step (its ``flux_step`` with ``sde_solver=True``) from `x` at `s` to `s_next`:
    ``mu = x + dsigma * v - 0.5 * eta^2 * s_hat * dsigma`` with ``dsigma = s_next - s`` (< 0), the data estimate
    ``x0_hat = x - s * v`` and the score estimate ``s_hat = -(x - (1 - s) * x0_hat) / s^2``; its std is ``eta *
    sqrt(s - s_next)`` (a constant diffusion coefficient ``g = eta``).

    Args:
        x (`torch.FloatTensor` of shape `[N, ...]`), v (`torch.FloatTensor` of shape `[N, ...]`): latent and velocity.
        s (`torch.FloatTensor` of shape `[N, 1, ...]`), s_next (`torch.FloatTensor` of shape `[N, 1, ...]`): the
            sigmas (``s > 0``).
    """
    dsigma = s_next - s  # [N, 1, ...] < 0
    x0_hat = x - s * v
    score = -(x - (1 - s) * x0_hat) / s**2
    return x + dsigma * v - 0.5 * noise_level**2 * score * dsigma


def _check_density(std: torch.Tensor, noise_level: float) -> None:
    """Refuses an SDE transition whose variance underflows float32 (its log-density would be NaN or inf)."""
    if bool((std.float() ** 2 < torch.finfo(torch.float32).tiny).any()):
        raise ValueError(
            f"the SDE step's standard deviation {float(std.min()):.3g} is too small for a float32 log-density: raise "
            f"noise_level ({noise_level}) or the step's sigma - sigma_next, or use noise_level 0 (a deterministic step)."
        )


def flow_sde_step(
    velocity: torch.Tensor,
    sample: torch.Tensor,
    sigma: float | torch.Tensor,
    sigma_next: float | torch.Tensor,
    *,
    noise_level: float = 0.7,
    sde_type: str = "sde",
    sigma_at_one: float | torch.Tensor | None = None,
    prev_sample: torch.Tensor | None = None,
    noise: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> FlowStepOutput:
    """Takes (or re-scores) one step of the reverse-time flow SDE.

    Args:
        velocity (`torch.FloatTensor` of shape `[N, ...]`): the model's velocity (after guidance, if any).
        sample (`torch.FloatTensor` of shape `[N, ...]`): the current latent `x` at `sigma`.
        sigma (`float` or `torch.FloatTensor` of shape `[N]`): current noise level.
        sigma_next (`float` or `torch.FloatTensor` of shape `[N]`): next noise level (smaller).
        noise_level (`float`): eta; 0 makes the SDE step an ODE step.
        sde_type (`str`): ``"sde"`` (Flow-GRPO, marginal-preserving SDE), ``"cps"`` (coefficients-preserving),
            ``"dance"`` (DanceGRPO's SDE, see [`dance_step_mean`]) or ``"ode"`` (Euler).
        sigma_at_one (`float`, *optional*): for ``"sde"``, the value used instead of `sigma` in ``1 - sigma`` when
            ``sigma == 1`` (Flow-GRPO uses the schedule's second sigma) to avoid dividing by zero.
        prev_sample (`torch.FloatTensor`, *optional*): re-score this next latent instead of sampling one.
        noise (`torch.FloatTensor`, *optional*): the standard normal noise to use when sampling.
        generator (`torch.Generator`, *optional*): used to draw `noise` when neither it nor `prev_sample` is given.

    Returns:
        [`FlowStepOutput`]. ``"sde"``, ``"dance"``: exact Gaussian log-density averaged over elements. ``"cps"``: the
        CPS surrogate ``-mean((x' - mean)^2)`` (constants and the 1/(2 std^2) scale dropped, as its authors do).

    Raises:
        `ValueError`: for the inputs [`check_step`] refuses, and for an ``"sde"`` transition whose standard deviation
        underflows float32.
    """
    check_step(sigma, sigma_next, noise_level=noise_level, sde_type=sde_type, sigma_at_one=sigma_at_one)
    x = sample.float()
    v = velocity.float()
    s = _as_batch(sigma, x)
    s_next = _as_batch(sigma_next, x)
    dt = s_next - s  # < 0

    if sde_type == "ode" or noise_level == 0:
        mean = x + dt * v
        std = torch.zeros_like(s)
        noise_scale = std
    elif sde_type == "sde":
        s_safe = s if sigma_at_one is None else torch.where(s >= 1, _as_batch(sigma_at_one, x), s)
        std_t = noise_level * torch.sqrt(s / (1 - s_safe))  # Flow-GRPO's sigma_t
        mean = x * (1 + std_t**2 / (2 * s) * dt) + v * (1 + std_t**2 * (1 - s) / (2 * s)) * dt
        std = std_t * torch.sqrt(-dt)
        noise_scale = std_t
        _check_density(std, noise_level)
    elif sde_type == "dance":
        mean = dance_step_mean(x, v, s, s_next, noise_level)
        noise_scale = torch.full_like(s, float(noise_level))  # DanceGRPO's g(t) = eta
        std = noise_scale * torch.sqrt(-dt)
        _check_density(std, noise_level)
    else:  # cps
        std = s_next * math.sin(noise_level * math.pi / 2)
        noise_scale = std
        x0_hat = x - s * v
        x1_hat = x + (1 - s) * v
        mean = (1 - s_next) * x0_hat + torch.sqrt(torch.clamp(s_next**2 - std**2, min=0)) * x1_hat

    deterministic = bool((std == 0).all())
    if prev_sample is None:
        if deterministic:
            prev = mean
        else:
            if noise is None:
                noise = torch.randn(x.shape, generator=generator, device=x.device, dtype=torch.float32)
            prev = mean + std * noise.float()
    else:
        prev = prev_sample.float()

    reduce_dims = tuple(range(1, x.dim()))
    if deterministic:
        log_prob = torch.zeros(x.shape[0], device=x.device)
    elif sde_type == "cps":
        log_prob = -((prev.detach() - mean) ** 2).mean(dim=reduce_dims)
    else:
        log_prob = (
            -((prev.detach() - mean) ** 2) / (2 * std**2) - torch.log(std) - 0.5 * math.log(2 * math.pi)
        ).mean(dim=reduce_dims)
    return FlowStepOutput(prev_sample=prev, log_prob=log_prob, mean=mean, std=std, noise_scale=noise_scale)


def flow_sde_std(
    sigma: float | torch.Tensor,
    sigma_next: float | torch.Tensor,
    *,
    noise_level: float = 0.7,
    sde_type: str = "sde",
    sigma_at_one: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """Standard deviation of the transition [`flow_sde_step`] takes from `sigma` to `sigma_next` (0 for the ODE).

    A step may jump several scheduler intervals at once (E-GRPO's merged step): ``"sde"`` then uses the noise scale
    at `sigma` over the whole ``|sigma_next - sigma|``, exactly as [`flow_sde_step`] does.

    Returns:
        `torch.FloatTensor` of shape `[]` (or the broadcast shape of the sigmas).
    """
    check_step(sigma, sigma_next, noise_level=noise_level, sde_type=sde_type, sigma_at_one=sigma_at_one)
    s = torch.as_tensor(sigma, dtype=torch.float32)
    s_next = torch.as_tensor(sigma_next, dtype=torch.float32)
    if sde_type == "ode" or noise_level == 0:
        return torch.zeros_like(s)
    if sde_type == "cps":
        return s_next * math.sin(noise_level * math.pi / 2)
    if sde_type == "dance":
        return noise_level * torch.sqrt(s - s_next)
    s_safe = s if sigma_at_one is None else torch.where(s >= 1, torch.as_tensor(sigma_at_one, dtype=torch.float32), s)
    return noise_level * torch.sqrt(s / (1 - s_safe)) * torch.sqrt(s - s_next)


def gaussian_entropy(std: float | torch.Tensor) -> torch.Tensor:
    """Differential entropy per element of ``N(mu, std^2 I)``: ``0.5 * log(2 * pi * e * std^2)`` nats (-inf at 0)."""
    std = torch.as_tensor(std, dtype=torch.float32)
    return 0.5 * torch.log(2 * math.pi * math.e * std**2)


def entropy_merge_span(
    sigmas: torch.Tensor,
    start: int,
    min_entropy: float,
    *,
    noise_level: float,
    sde_type: str = "sde",
    max_span: int,
) -> int:
    """E-GRPO's adaptive merge: the fewest scheduler intervals `m` (``1 <= m <= max_span``, not past the last sigma)
    such that one SDE transition from ``sigmas[start]`` to ``sigmas[start + m]`` has entropy per element of at least
    `min_entropy`; `max_span` (or what is left) when no span reaches it.

    Args:
        sigmas (`torch.FloatTensor` of shape `[S + 1]`): the noise levels, falling to 0.
        start (`int`): the SDE step.
    """
    if not 0 <= start < len(sigmas) - 1 or max_span < 1:
        raise ValueError(
            f"entropy_merge_span needs 0 <= start < {len(sigmas) - 1} (a step with a next sigma) and max_span >= 1, got "
            f"start {start} and max_span {max_span}."
        )
    last = min(max_span, len(sigmas) - 1 - start)
    for m in range(1, last + 1):
        std = flow_sde_std(sigmas[start], sigmas[start + m], noise_level=noise_level, sde_type=sde_type,
                           sigma_at_one=sigmas[1])
        if float(gaussian_entropy(std)) >= min_entropy:
            return m
    return last
