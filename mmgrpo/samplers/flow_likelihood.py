"""Scoring a flow-matching rollout by likelihood instead of by its trajectory (DGPO, ``FlowPlan.scoring =
"likelihood"``): [`plan_likelihood`] is minus the flow-matching loss of the final samples at the plan's noise levels,
with the noise shared within a group, for the flow adapters' ``likelihood``."""

from __future__ import annotations

import torch

from mmgrpo.samplers.flow_plan import Noise, Velocity, group_noise
from mmgrpo.types import Score


def plan_likelihood(
    velocity: Velocity,
    noise: Noise,
    trajectory: dict,
    group_ids: torch.Tensor,
    steps: list[int],
    device: torch.device,
) -> Score:
    """Minus the flow-matching loss of the final samples ``x0`` at noise levels ``sigmas[j]``, `j` in `steps`.

    ``x_t = (1 - s) x0 + s eps``, target ``eps - x0``, ``eps`` shared within a group and fixed by the plan's seed, the
    group and `j` (so the policy, its reference and an old copy see the same noise on every process).

    Returns:
        [`Score`] with `log_prob` `[n, k]` (``-mean((v - target)^2)`` per sample), `velocity` `[n, k, ...]` and
        `group_ids` `[n]`.
    """
    x0 = trajectory["latents"][:, -1].to(device).float()  # [n, ...]
    sigmas, seed = trajectory["shared_sigmas"], trajectory["shared_seed"]
    dims = tuple(range(1, x0.dim()))
    log_probs, velocities = [], []
    for j in steps:
        eps = group_noise(noise, group_ids, seed, salt=j).to(device).float()  # [n, ...]
        s = sigmas[j].to(device)
        v = velocity((1 - s) * x0 + s * eps, sigmas[j], None)
        log_probs.append(-((v - (eps - x0)) ** 2).mean(dim=dims))
        velocities.append(v)
    return Score(
        log_prob=torch.stack(log_probs, dim=1),  # [n, k]
        velocity=torch.stack(velocities, dim=1),  # [n, k, ...]
        group_ids=group_ids,  # [n]
    )
