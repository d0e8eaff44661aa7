"""The plain flow sampling loop, shared by the flow samplers: SDE on a plan's SDE steps, Euler ODE elsewhere, every
sample on the same steps ([`sample_flow`]). The plan's other features are interpreted in
[`mmgrpo.samplers.flow_plan`].
"""

from __future__ import annotations

from typing import Callable

import torch

from mmgrpo.plans import FlowPlan
from mmgrpo.samplers.flow_record import recorded
from mmgrpo.samplers.flow_sde import flow_sde_step

# velocity(latents [n, ...], step index i) -> velocity [n, ...] in float32 at the step's noise level (plain loop)
StepVelocity = Callable[[torch.Tensor, int], torch.Tensor]


def sample_flow(
    velocity: StepVelocity,
    latents: torch.Tensor,
    sigmas: torch.Tensor,
    plan: FlowPlan,
    generator: torch.Generator | None = None,
) -> tuple[dict, torch.Tensor, torch.Tensor]:
    """Runs a flow sampler from pure noise following `plan`: SDE on `plan.sde_steps`, ODE elsewhere.

    Args:
        velocity (`Callable`): ``velocity(latents, i)``, the (guided) model velocity at step `i`.
        latents (`torch.FloatTensor` of shape `[N, ...]`): the initial noise (at ``sigmas[0]``).
        sigmas (`torch.FloatTensor` of shape `[S + 1]`): the noise levels, ending at 0.
        plan ([`FlowPlan`]): which steps are stochastic and which are trained.
        generator (`torch.Generator`, *optional*): draws the SDE noise (on the CPU, then moved to the latents' device).

    Returns:
        `tuple`: the replay state (``latents`` `[N, S + 1, ...]` and the ``shared_*`` step parameters), the
        log-probabilities `[N, S]` of the steps taken (on the CPU) and the trained-step mask `[N, S]`.
    """
    n = latents.shape[0]
    noise_levels = torch.tensor([plan.noise_level if i in plan.sde_steps else 0.0 for i in range(plan.num_steps)])
    states, log_probs, means = [latents], [], []  # means: feature "old_mean", those of the trained steps
    for i in range(plan.num_steps):
        v = velocity(latents, i)
        noise = torch.randn(latents.shape, generator=generator).to(latents.device) if noise_levels[i] > 0 else None
        step = flow_sde_step(
            v, latents, sigmas[i], sigmas[i + 1], noise_level=float(noise_levels[i]), sde_type=plan.sde_type,
            sigma_at_one=sigmas[1], noise=noise,
        )
        latents = step.prev_sample
        states.append(latents)
        log_probs.append(step.log_prob)
        means += [step.mean] if plan.record_mean and i in plan.trained_steps else []
    mask = torch.zeros(n, plan.num_steps, dtype=torch.bool)
    mask[:, [s for unit in plan.train_units for s in unit]] = True
    trajectory = {
        "latents": torch.stack(states, dim=1),  # [N, S + 1, ...]
        "shared_sigmas": sigmas,  # [S + 1]
        "shared_noise_levels": noise_levels,  # [S]
        "shared_sde_type": plan.sde_type,
        **recorded(plan, means),  # feature "old_mean": old_means [N, T, ...]
    }
    return trajectory, torch.stack(log_probs, dim=1).cpu(), mask  # [N, S], [N, S]
