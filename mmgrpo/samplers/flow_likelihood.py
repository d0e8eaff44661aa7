"""Scoring a flow-matching rollout by likelihood instead of by its trajectory (DGPO, DiffusionNFT, AWM:
``FlowPlan.scoring = "likelihood"``): [`plan_likelihood`] is minus the flow-matching loss of the final samples at the
plan's noise levels, with the noise shared within a group (``likelihood_noise="group"``) or drawn per sample (feature
``"sample_noise"``), for the flow adapters' ``likelihood``."""

from __future__ import annotations

import torch

from mmgrpo.samplers.flow_plan import Noise, Velocity, group_noise
from mmgrpo.seeding import mix_seed
from mmgrpo.types import Score


def sample_noise(noise: Noise, group_ids: torch.Tensor, member_ids: torch.Tensor, seed: int, salt: int) -> torch.Tensor:
    """Standard normal latents `[N, ...]`, one draw per sample (feature ``"sample_noise"``): sample `m` of group `g`
    draws from a generator seeded with ``(seed, g, m, salt)``, so the same sample gets the same noise on any process,
    in any minibatch, under the policy, its old model and its reference, and two samples never share it."""
    draws = [
        noise(1, torch.Generator().manual_seed(mix_seed(seed, g, m, salt, offset=11)))
        for g, m in zip(group_ids.tolist(), member_ids.tolist())
    ]
    return torch.cat(draws)


def plan_likelihood(
    velocity: Velocity,
    noise: Noise,
    trajectory: dict,
    group_ids: torch.Tensor,
    steps: list[int],
    device: torch.device,
) -> Score:
    """Minus the flow-matching loss of the final samples ``x0`` at noise levels ``sigmas[j]``, `j` in `steps`.

    ``x_t = (1 - s) x0 + s eps``, target ``eps - x0``, ``eps`` fixed by the plan's seed and `j`: shared within a group
    (keyed by the group) or, when the rollout recorded ``member_ids`` (feature ``"sample_noise"``), one per sample
    (keyed by its group and member), so the policy, its reference and an old copy see the same noise on every process.

    Returns:
        [`Score`] with `log_prob` `[n, k]` (``-mean((v - target)^2)`` per sample), `velocity` `[n, k, ...]`, `target`
        `[n, k, ...]`, `sigma` `[n, k]` and `group_ids` `[n]`.
    """
    x0 = trajectory["latents"][:, -1].to(device).float()  # [n, ...]
    sigmas, seed = trajectory["shared_sigmas"], trajectory["shared_seed"]
    members = trajectory.get("member_ids")  # [n] with per-sample noise, else None
    dims = tuple(range(1, x0.dim()))
    log_probs, velocities, targets = [], [], []
    for j in steps:
        if members is None:
            eps = group_noise(noise, group_ids, seed, salt=j)  # [n, ...]
        else:
            eps = sample_noise(noise, group_ids, members, seed, salt=j)  # [n, ...]
        eps = eps.to(device).float()
        s = sigmas[j].to(device)
        v = velocity((1 - s) * x0 + s * eps, sigmas[j], None)
        target = eps - x0  # [n, ...]
        log_probs.append(-((v - target) ** 2).mean(dim=dims))
        velocities.append(v)
        targets.append(target)
    levels = torch.stack([sigmas[j] for j in steps]).to(device).float()  # [k]
    return Score(
        log_prob=torch.stack(log_probs, dim=1),  # [n, k]
        velocity=torch.stack(velocities, dim=1),  # [n, k, ...]
        target=torch.stack(targets, dim=1),  # [n, k, ...]
        sigma=levels.expand(x0.shape[0], -1),  # [n, k]
        group_ids=group_ids,  # [n]
    )
