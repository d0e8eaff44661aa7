"""The deterministic DPM-Solver++ rollouts of flow plans, both on diffusers' `DPMSolverMultistepScheduler` configured
for flow matching (``prediction_type="flow_prediction"``: ``x0_hat = x - sigma v``, ``alpha = 1 - sigma``):

- [`sample_dpm`] (feature ``"dpm"``, ``FlowPlan.solver == "dpm"``): the whole trajectory, 2nd order multistep on the
  scheduler's flow sigmas with ``plan.flow_shift`` (DGPO's rollout, DiffusionNFT's ``solver: dpm``).
- [`sample_post_dpm`] (feature ``"dpm_post"``, ``FlowPlan.dpm_post_ratio > 0``): MixGRPO-Flash. The steps up to the
  last SDE step ``b`` are the plain loop's ([`~mmgrpo.samplers.flow_loop.sample_flow`]: SDE on the window, Euler
  ODE before it); the ODE after it is DPM-Solver++ (2nd order multistep, final step 1st order) on a compressed
  schedule of ``K = max(int(max((S - b) * ratio, 1)), 2)`` noise levels from ``sigma_{b+1}`` to 0 ([`post_levels`]),
  so ``K - 1`` transitions replace the ``S - b - 1`` Euler steps. As the authors' code (their ``--flow_grpo_sampling``
  path), the DPM history starts with the ``x0_hat`` of step ``b`` (from its input latent), so the first DPM step is
  already 2nd order; with DanceGRPO's SDE (``sde_type: dance``) their code keeps no history, and the first DPM step is
  1st order.

Paper: https://arxiv.org/abs/2507.21802 (code: Tencent-Hunyuan/MixGRPO, ``fastvideo/utils/sampling_utils.py``,
``run_sample_step`` with ``dpm_apply_strategy: post``).
"""

from __future__ import annotations

import dataclasses

import torch

from mmgrpo.plans import FlowPlan
from mmgrpo.samplers.flow_loop import sample_flow


def dpm_scheduler(flow_shift: float = 3.0, solver_type: str = "midpoint"):
    """Diffusers' DPM-Solver++ (2nd order multistep, deterministic) for flow matching, ending at sigma 0 with a 1st
    order step."""
    from diffusers import DPMSolverMultistepScheduler

    return DPMSolverMultistepScheduler(
        prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=flow_shift, solver_order=2,
        algorithm_type="dpmsolver++", solver_type=solver_type, final_sigmas_type="zero", lower_order_final=True,
    )


def _on_levels(scheduler, levels: torch.Tensor):
    """`scheduler` set to run on the noise levels `levels` `[K + 1]` (ending at 0) instead of its own flow sigmas."""
    scheduler.set_timesteps(len(levels) - 1, device="cpu")  # resets the history
    scheduler.sigmas = levels.float().cpu()
    scheduler.timesteps = (levels[:-1].float() * scheduler.config.num_train_timesteps).cpu()
    scheduler.set_begin_index(0)
    return scheduler


@torch.no_grad()
def sample_dpm(velocity, x: torch.Tensor, plan: FlowPlan) -> tuple[dict, torch.Tensor, torch.Tensor]:
    """Deterministic DPM-Solver++ (2nd order multistep) for flow matching on the scheduler's own flow sigmas (with
    ``plan.flow_shift``), as DGPO samples: latents `[N, ...]` -> the replay state, zero log-probs `[N, S]` and the
    trained mask `[N, S]`."""
    scheduler = dpm_scheduler(plan.flow_shift)
    scheduler.set_timesteps(plan.num_steps, device="cpu")
    sigmas = scheduler.sigmas.float().clone()  # [S + 1]
    states = [x]
    for i, timestep in enumerate(scheduler.timesteps):
        v = velocity(x, sigmas[i], None)
        x = scheduler.step(v, timestep, x.float(), return_dict=False)[0]
        states.append(x)
    n = x.shape[0]
    mask = torch.zeros(n, plan.num_steps, dtype=torch.bool)
    mask[:, plan.trained_steps] = True
    trajectory = {
        "latents": torch.stack(states, dim=1),  # [N, S + 1, ...]
        "shared_sigmas": sigmas,  # [S + 1]
        "shared_noise_levels": torch.zeros(plan.num_steps),  # [S]
        "shared_sde_type": "ode",
    }
    return trajectory, torch.zeros(n, plan.num_steps), mask


def post_levels(sigmas: torch.Tensor, last: int, ratio: float) -> torch.Tensor:
    """MixGRPO-Flash's compressed noise levels `[K]` after SDE step `last`, from ``sigmas[last + 1]`` to 0.

    The authors rebuild them as ``shift(linspace(t, 0, K))`` with ``t = linspace(1, 0, S + 1)[last + 1]``, ``shift``
    the SD3 time shift ``s t / (1 + (s - 1) t)`` of their schedule and ``K = int(max((S - last) * ratio, 1))``. Here
    ``s`` is the shift that maps ``t`` to the pipeline's ``sigmas[last + 1]``, so the levels are exactly the authors'
    where the pipeline's sigmas are a time shift of ``linspace(1, 0, S + 1)`` (SD3, FLUX, Wan), and the first level is
    always ``sigmas[last + 1]``. ``K`` is at least 2, so the last level is 0 (the authors' ``K = 1`` would stop there).

    Args:
        sigmas (`torch.FloatTensor` of shape `[S + 1]`): the pipeline's noise levels, ending at 0.
        last (`int`): the last SDE step, at most ``S - 2``.
        ratio (`float`): ``dpm_post_compress_ratio``, in ``(0, 1]``.
    """
    num = len(sigmas) - 1
    if not 0 <= last <= num - 2:
        raise ValueError(f"MixGRPO-Flash needs an ODE step after the last SDE step {last} of {num} steps.")
    count = max(int(max((num - last) * ratio, 1)), 2)
    t0, s0 = 1.0 - (last + 1) / num, float(sigmas[last + 1])
    shift = s0 * (1.0 - t0) / (t0 * (1.0 - s0))  # the time shift through (t0, s0)
    t = torch.linspace(t0, 0.0, count, dtype=torch.float64)
    levels = (shift * t / (1 + (shift - 1) * t)).float()  # [K]
    levels[0] = sigmas[last + 1]
    return levels


@torch.no_grad()
def sample_post_dpm(velocity, x: torch.Tensor, sigmas: torch.Tensor, plan: FlowPlan,
                    generator: torch.Generator | None) -> tuple[dict, torch.Tensor, torch.Tensor]:
    """MixGRPO-Flash's rollout (see the module docstring) from latents `x` `[N, ...]` on the pipeline's `sigmas`.

    Returns:
        `tuple`: the replay state, log-probabilities `[N, S]` (0 off the SDE steps) and the trained mask `[N, S]`, as
        [`~mmgrpo.samplers.flow_loop.sample_flow`]'s. ``latents`` `[N, S + 1, ...]` holds the ``b + 2`` states up to
        ``sigma_{b+1}``, then the ``K - 1`` DPM states, then the final latent repeated; ``shared_sigmas`` `[S + 1]` the
        noise levels of those states (0 after the end).
    """
    last, num = max(plan.sde_steps), plan.num_steps
    head = dataclasses.replace(plan, num_steps=last + 1, dpm_post_ratio=0.0)
    seen = {}

    def step_velocity(latents, i):
        v = velocity(latents, sigmas[i], None)
        if i == last:  # the x0_hat of the last SDE step starts the DPM history
            seen.update(x=latents, v=v)
        return v

    trajectory, log_probs, mask = sample_flow(step_velocity, x, sigmas[: last + 2], head, generator)
    levels = post_levels(sigmas, last, plan.dpm_post_ratio)  # [K]
    warm = plan.sde_type != "dance"  # the authors keep the history on their Flow-GRPO SDE path only
    grid = torch.cat([sigmas[last : last + 1].float(), levels]) if warm else levels
    scheduler = _on_levels(dpm_scheduler(solver_type=plan.dpm_solver_type), grid)
    if warm:  # its update is discarded: the window's SDE step was taken
        scheduler.step(seen["v"], scheduler.timesteps[0], seen["x"].float(), return_dict=False)
    latents = trajectory["latents"]  # [N, b + 2, ...]
    x, states = latents[:, -1], []
    for k in range(int(warm), len(grid) - 1):
        v = velocity(x, grid[k], None)
        x = scheduler.step(v, scheduler.timesteps[k], x.float(), return_dict=False)[0].to(latents.dtype)
        states.append(x)
    pad = num + 1 - (latents.shape[1] + len(states))
    latents = torch.cat([latents, torch.stack(states, dim=1), x[:, None].expand(-1, pad, *x.shape[1:])], dim=1)
    n = x.shape[0]
    trajectory.update(
        latents=latents,  # [N, S + 1, ...]
        shared_sigmas=torch.cat([sigmas[: last + 2].float(), levels[1:], torch.zeros(pad)]),  # [S + 1]
        shared_noise_levels=torch.cat([trajectory["shared_noise_levels"], torch.zeros(num - last - 1)]),  # [S]
    )
    grown = torch.zeros(n, num - last - 1)
    return trajectory, torch.cat([log_probs, grown], dim=1), torch.cat([mask, grown.bool()], dim=1)
