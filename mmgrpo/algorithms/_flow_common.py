"""Pieces two or more flow algorithms share, written once: the per-step SDE plan and the clipped objective of the
algorithms built on DanceGRPO's FastVideo code (`dance_grpo`, `mix_grpo`), and the likelihood plan of the algorithms
trained on deterministic rollouts at drawn noise levels (`diffusion_nft`, `awm`). Not a plugin: the name starts with
an underscore.
"""

from __future__ import annotations

import torch

from ..losses import clipped_surrogate
from ..plans import FlowPlan
from ._options import AdvantageOptions, ClipOptions, SDEOptions


def per_step_plan(num_steps: int, steps: list[int], sde: SDEOptions, init_same_noise: bool,
                  generator: torch.Generator | None, units_per_sample: int = 0, **features) -> FlowPlan:
    """SDE (`sde`'s) on `steps`, ODE elsewhere, each SDE step one trained unit (each sample training
    `units_per_sample` of them, drawn per sample; 0: all), the members of a group starting from one initial noise with
    `init_same_noise`; the seed drawn from `generator`; `features`: further [`FlowPlan`] fields (MixGRPO-Flash's
    ``dpm_post_ratio``)."""
    return FlowPlan(
        num_steps=num_steps,
        sde_steps=steps,
        train_units=[[s] for s in steps],
        noise_level=sde.noise_level,
        sde_type=sde.sde_type,
        units_per_sample=units_per_sample,
        init_same_noise=init_same_noise,
        seed=int(torch.randint(0, 2**62, (1,), generator=generator)),
        **features,
    )


def fastvideo_surrogate(log_ratio: torch.Tensor, advantages: torch.Tensor, advantage: AdvantageOptions,
                        clip: ClipOptions, mask: torch.Tensor | None) -> tuple[torch.Tensor, dict]:
    """DanceGRPO's clipped per-step objective (MixGRPO keeps it): the advantages `[n]` clamped to ``[-adv_clip_max,
    adv_clip_max]`` in the loss, as the authors' code does (so also those a `composite` reward gives as they are),
    then [`~mmgrpo.losses.clipped_surrogate`] of `log_ratio` `[n, k]` clipped to ``[1 - clip_low, 1 + clip_high]``
    over `mask` `[n, k]`. Returns the loss and its metrics."""
    bound = advantage.adv_clip_max
    advantages = advantages if bound is None else advantages.clamp(-bound, bound)  # [n]
    return clipped_surrogate(log_ratio, advantages, clip.clip_low, clip.high, mask)


def likelihood_plan(num_steps: int, levels: list[int], solver: str, flow_shift: float,
                    generator: torch.Generator | None) -> FlowPlan:
    """Deterministic rollouts with `solver` (and `flow_shift`); the noise levels `levels`, one trained unit each,
    scored by likelihood with noise drawn per sample; the seed drawn from `generator`."""
    return FlowPlan(
        num_steps=num_steps,
        sde_steps=[],
        train_units=[[j] for j in levels],
        noise_level=0.0,
        solver=solver,
        flow_shift=flow_shift,
        scoring="likelihood",
        likelihood_noise="sample",
        seed=int(torch.randint(0, 2**62, (1,), generator=generator)),
    )
