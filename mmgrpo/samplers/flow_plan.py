"""Everything that interprets a flow-matching sampling plan, for the flow adapters (`sd3`, `flux`, `wan`), which wire
their model in as small callables (see `pipelines/_flow_policy.py`) and own no sampling loop:

- [`run_plan`] (``sample``): plain plans go to [`~mmgrpo.samplers.flow_loop.sample_flow`] (SDE on the plan's SDE
  steps, ODE elsewhere); merged SDE steps and group branches from one shared ODE anchor (E-GRPO) and per-sample
  trained units (Chunk-GRPO, [`select_units`]) are handled here; the DPM-Solver++ rollouts (DGPO's, and
  MixGRPO-Flash's after the SDE window) in [`mmgrpo.samplers.flow_dpm`]; BranchGRPO's tree rollouts in
  [`mmgrpo.samplers.flow_tree`].
- [`replay_plan`] (``log_prob``): replays only the transitions a sample trains; a step taken from a group's shared
  anchor is forwarded once per group, not once per sample.
- [`~mmgrpo.samplers.flow_likelihood.plan_likelihood`] (``likelihood``, its own module): minus the flow-matching
  loss of the final samples at the plan's noise levels, with noise shared within a group (DGPO).

The steps themselves are [`mmgrpo.samplers.flow_sde.flow_sde_step`] (stateless math, fp32 inside).
"""


from __future__ import annotations

from typing import Callable

import torch

from mmgrpo.plans import FLOW_PLAN_FEATURES, FlowPlan
from mmgrpo.samplers.flow_dpm import sample_dpm, sample_post_dpm
from mmgrpo.samplers.flow_loop import sample_flow
from mmgrpo.samplers.flow_record import path_recorded, path_state, record_path_step, recorded_means
from mmgrpo.samplers.flow_sde import entropy_merge_span, flow_sde_step
from mmgrpo.samplers.flow_tree import sample_tree
from mmgrpo.seeding import mix_seed
from mmgrpo.types import Score

PLAN_FEATURES = FLOW_PLAN_FEATURES  # this interpretation implements every feature a flow plan names
# scoring method -> the `Score` fields a flow adapter fills ([`replay_plan`], [`~mmgrpo.samplers.flow_likelihood.plan_likelihood`])
SCORE_FIELDS = {
    "log_prob": frozenset({"log_prob", "mask", "mean", "std", "noise_scale", "old_mean"}),
    "likelihood": frozenset({"log_prob", "velocity", "group_ids", "target", "sigma"}),
}


# velocity(latents [r, ...], sigma [], rows [r] or None for all samples) -> velocity [r, ...] in float32; `rows` pick
# the samples' conditioning (text embeddings...)
Velocity = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]
# noise(count, generator) -> standard normal initial latents [count, ...] in the adapter's latent layout
Noise = Callable[[int, "torch.Generator | None"], torch.Tensor]


def group_noise(noise: Noise, group_ids: torch.Tensor, seed: int, salt: int) -> torch.Tensor:
    """Standard normal latents `[N, ...]`, identical for samples of one group (on any process): group `g` draws from
    a generator seeded with ``(seed, g, salt)``."""
    unique, inverse = torch.unique(group_ids, return_inverse=True)
    draws = torch.cat([noise(1, torch.Generator().manual_seed(mix_seed(seed, g, salt, offset=7))) for g in unique.tolist()])
    return draws[inverse.to(draws.device)]


def relative_change(latents: torch.Tensor) -> torch.Tensor:
    """Relative L1 change of each step, ``mean|x_{i+1} - x_i| / mean|x_i|``: latents `[N, S + 1, ...]` -> `[N, S]`."""
    dims = tuple(range(2, latents.dim()))
    change = (latents[:, 1:] - latents[:, :-1]).abs().mean(dim=dims)
    return (change / (latents[:, :-1].abs().mean(dim=dims) + 1e-8)).float().cpu()


def branch_index(plan: FlowPlan, member_ids: torch.Tensor) -> torch.Tensor:
    """Which branch (index into `sde_steps`) each sample takes: ``member_ids % len(sde_steps)``, `[N]`."""
    if member_ids is None:
        raise ValueError("A branching plan needs PromptBatch.member_ids (set by PromptBatch.repeat).")
    return member_ids.long() % len(plan.sde_steps)


def branch_group_ids(plan: FlowPlan, group_ids: torch.Tensor, member_ids: torch.Tensor) -> torch.Tensor:
    """Group ids after branching, `[N]`: samples share one iff they share the prompt group and the SDE step."""
    return group_ids.long() * len(plan.sde_steps) + branch_index(plan, member_ids)


def select_units(
    plan: FlowPlan, n: int, step_change: torch.Tensor | None, generator: torch.Generator | None
) -> torch.Tensor:
    """Per-sample choice of the plan's `units_per_sample` trained units (feature ``"unit_selection"``).

    Args:
        plan ([`FlowPlan`]): the plan, with `train_units`, `units_per_sample` and `unit_weighting`.
        n (`int`): number of samples.
        step_change (`torch.FloatTensor` of shape `[n, S]`, *optional*): relative latent change of each step,
            needed by ``unit_weighting="latent_change"``.
        generator (`torch.Generator`, *optional*): draws the units.

    Returns:
        `torch.BoolTensor` of shape `[n, S]`: the trained steps of each sample (all steps of its chosen units).
    """
    mask = torch.zeros(n, plan.num_steps, dtype=torch.bool)
    k = plan.units_per_sample or len(plan.train_units)
    if plan.unit_weighting == "latent_change":
        if step_change is None:
            raise ValueError("unit_weighting='latent_change' needs the per-step latent change of the samples.")
        weights = torch.stack([step_change[:, unit].float().mean(dim=1) for unit in plan.train_units], dim=1)
        weights = weights.clamp_min(0) + 1e-8  # [n, U]
    else:
        weights = torch.ones(n, len(plan.train_units))  # [n, U]
    probabilities = weights / weights.sum(dim=1, keepdim=True)  # [n, U]
    chosen = torch.multinomial(probabilities, k, replacement=False, generator=generator)  # [n, k]
    for row, units in enumerate(chosen.tolist()):
        mask[row, [s for u in units for s in plan.train_units[u]]] = True
    return mask  # [n, S]


def run_plan(
    velocity: Velocity,
    noise: Noise,
    sigmas: torch.Tensor,
    plan: FlowPlan,
    group_ids: torch.Tensor,
    member_ids: torch.Tensor | None,
    generator: torch.Generator | None,
) -> tuple[dict, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Samples `N` latents following `plan`.

    Args:
        velocity (`Velocity`), noise (`Noise`): the adapter's model and initial-noise draw.
        sigmas (`torch.FloatTensor` of shape `[S + 1]`): the adapter's noise levels (unused by the ``"dpm"`` solver).
        plan ([`FlowPlan`]): the algorithm's plan.
        group_ids (`torch.LongTensor` of shape `[N]`), member_ids (`torch.LongTensor` of shape `[N]`, *optional*).
        generator (`torch.Generator`, *optional*): this process's sampling generator.

    Returns:
        `tuple`: the replay state (``latents`` `[N, S + 1, ...]` and step parameters; keys starting with ``shared_``
        are not per sample), log-probabilities `[N, S]` (CPU), the trained mask `[N, S]` and the rollout's group ids
        `[N]` (re-keyed by branch for branching plans).
    """
    n = len(group_ids)
    if plan.init_same_noise:  # DanceGRPO's: one initial noise per group, the same on every process
        shared = group_noise(noise, group_ids, plan.seed, salt=-2)  # [N, ...]
        noise = lambda count, generator=None: shared  # noqa: E731 (every remaining path draws the N initial latents)
    if plan.tree_split_points:  # BranchGRPO's tree: one root per group, shared prefixes once per node
        trajectory, log_probs, mask = sample_tree(velocity, noise, sigmas, plan, group_ids, member_ids)
    elif plan.solver == "dpm":
        trajectory, log_probs, mask = sample_dpm(velocity, noise(n, generator), plan)
    elif plan.dpm_post_ratio and plan.sde_steps:  # MixGRPO-Flash: DPM-Solver++ after the last SDE step
        trajectory, log_probs, mask = sample_post_dpm(velocity, noise(n, generator), sigmas, plan, generator)
    elif plan.branch or plan.merge or plan.merge_entropy is not None:
        trajectory, log_probs, mask = _sample_paths(velocity, noise, sigmas, plan, group_ids, member_ids, generator)
        if plan.branch:
            group_ids = branch_group_ids(plan, group_ids, member_ids)
    else:  # a plain plan: exactly the shared loop (same random draws, same numbers)
        trajectory, log_probs, mask = sample_flow(
            lambda x, i: velocity(x, sigmas[i], None), noise(n, generator), sigmas, plan, generator
        )
    if plan.units_per_sample:
        change = relative_change(trajectory["latents"]) if plan.unit_weighting == "latent_change" else None
        mask = select_units(plan, n, change, generator)
    trajectory["shared_seed"] = plan.seed
    if plan.likelihood_noise == "sample":  # feature "sample_noise": a sample's likelihood noise is keyed by its member
        trajectory["member_ids"] = torch.arange(n) if member_ids is None else member_ids.long()
    return trajectory, log_probs, mask, group_ids


def _path(plan: FlowPlan, sde_steps: list[int], sigmas: torch.Tensor, start: int = 0) -> list[tuple]:
    """The transitions ``(i, end, noise_level)`` of one path from step `start`: SDE steps span their merge."""
    steps, i = [], start
    while i < plan.num_steps:
        if i in sde_steps:
            span = plan.merge.get(i)
            if span is None:
                span = 1 if plan.merge_entropy is None else entropy_merge_span(
                    sigmas, i, plan.merge_entropy, noise_level=plan.noise_level, sde_type=plan.sde_type,
                    max_span=plan.max_merge,
                )
            steps.append((i, i + span, plan.noise_level))
            i += span
        else:
            steps.append((i, i + 1, 0.0))
            i += 1
    return steps


def _sample_paths(velocity, noise, sigmas, plan, group_ids, member_ids, generator):
    """Merged SDE steps, optionally as group branches from one shared deterministic anchor per group."""
    n, num = len(group_ids), plan.num_steps
    if plan.branch:
        unique, inverse = torch.unique(group_ids, return_inverse=True)
        x = group_noise(noise, unique, plan.seed, salt=-1)  # [U, ...] one initial noise per group
    else:
        x = noise(n, generator)  # [N, ...]
    latents = x.new_zeros((n, num + 1, *x.shape[1:]))  # [N, S + 1, ...]
    log_probs = torch.zeros(n, num)  # [N, S]
    ends = torch.arange(1, num + 1).repeat(n, 1)  # [N, S] index of the sigma each step lands on
    levels = torch.zeros(n, num)  # [N, S]
    mask = torch.zeros(n, num, dtype=torch.bool)
    state = dict(latents=latents, log_probs=log_probs, ends=ends, levels=levels, **path_state(plan, n, x))
    trained = set(plan.trained_steps)
    if not plan.branch:
        latents[:, 0] = x
        path = _path(plan, plan.sde_steps, sigmas)
        _walk(velocity, x, torch.arange(n), path, sigmas, plan, generator, state)
        mask[:, [i for i, _, level in path if level > 0 and i in trained]] = True
    else:
        reps = torch.stack([torch.nonzero(group_ids == g)[0, 0] for g in unique])  # first sample of each group
        anchor, anchor_v = _anchor(velocity, x, reps, sigmas, plan)
        branch = branch_index(plan, member_ids)
        for k, step in enumerate(plan.sde_steps):
            rows = torch.nonzero(branch == k).flatten()
            if rows.numel() == 0:
                continue
            g = inverse[rows]
            latents[rows, : step + 1] = anchor[g, : step + 1]
            path = _path(plan, [step], sigmas, start=step)
            _walk(velocity, anchor[g, step], rows, path, sigmas, plan, generator, state, first_v=anchor_v[step][g])
            mask[rows, step] = step in trained
    trajectory = {
        "latents": latents,  # [N, S + 1, ...]; a merged step's skipped entries repeat the state it lands on
        "step_ends": ends,  # [N, S]
        "noise_levels": levels,  # [N, S]
        "shared_sigmas": sigmas,  # [S + 1]
        "shared_sde_type": plan.sde_type,
        "shared_anchor": plan.branch,  # the input of each sample's SDE step is its group's anchor state
        **path_recorded(state),  # feature "old_mean": old_means [N, T, ...]
    }
    return trajectory, log_probs, mask


@torch.no_grad()
def _anchor(velocity, x, reps, sigmas, plan):
    """The deterministic anchor of each group up to the last branch step: states `[U, b + 1, ...]` and the velocity
    at each branch step (`[U, ...]`), computed once per group."""
    last = max(plan.sde_steps)
    states, at_branch = [x], {}
    for i in range(last + 1):
        v = velocity(x, sigmas[i], reps)
        if i in plan.sde_steps:
            at_branch[i] = v
        if i < last:
            x = flow_sde_step(v, x, sigmas[i], sigmas[i + 1], noise_level=0.0, sde_type=plan.sde_type).prev_sample
            states.append(x)
    return torch.stack(states, dim=1), at_branch


def _walk(velocity, x, rows, path, sigmas, plan, generator, state, first_v=None):
    """Takes the transitions of `path` for samples `rows` from latents `x`, writing into `state`."""
    for t, (i, end, level) in enumerate(path):
        v = first_v if (t == 0 and first_v is not None) else velocity(x, sigmas[i], rows)
        noise = torch.randn(x.shape, generator=generator).to(x.device) if level > 0 else None
        step = flow_sde_step(
            v, x, sigmas[i], sigmas[end], noise_level=level, sde_type=plan.sde_type, sigma_at_one=sigmas[1], noise=noise
        )
        x = step.prev_sample
        state["latents"][rows, i + 1 : end + 1] = x[:, None].to(state["latents"].dtype)
        state["log_probs"][rows, i] = step.log_prob.cpu()
        state["ends"][rows, i] = end
        state["levels"][rows, i] = level
        record_path_step(state, rows, i, level, step.mean)


def replay_plan(
    velocity: Velocity,
    trajectory: dict,
    group_ids: torch.Tensor,
    mask: torch.Tensor,
    steps: list[int],
    device: torch.device,
) -> Score:
    """Re-scores stored transitions `steps` under the current `velocity`, for the samples that train them.

    A step no sample in the batch trains is replayed for every sample (so the values are real and the graph reaches
    the parameters). Steps taken from a shared anchor are forwarded once per group.

    Returns:
        [`Score`] with `log_prob` `[n, k]`, `mean` `[n, k, ...]`, `std` `[n, k, 1, ...]` and `mask` `[n, k]`
        (bool): the entries that are replayed transitions; the others are placeholders (log-prob 0, std 0, no
        gradient) that losses must ignore.
    """
    latents = trajectory["latents"].to(device)  # [n, S + 1, ...]
    n, num = latents.shape[0], latents.shape[1] - 1
    sigmas = trajectory["shared_sigmas"]
    if "noise_levels" in trajectory:  # per-sample paths (merged steps, branches)
        levels, ends = trajectory["noise_levels"], trajectory["step_ends"]  # [n, S], [n, S]
    else:
        levels = trajectory["shared_noise_levels"].expand(n, num)  # [n, S]
        ends = torch.arange(1, num + 1).expand(n, num)  # [n, S]
    outs, masks = [], []
    for i in steps:
        active = mask[:, i].cpu()
        rows = torch.nonzero(active).flatten() if active.any() else torch.arange(n)
        masks.append(active)
        end, level = int(ends[rows[0], i]), float(levels[rows[0], i])
        if bool((ends[rows, i] != end).any() or (levels[rows, i] != level).any()):
            raise ValueError(f"Step {i} is taken with different spans or noise levels by the replayed samples.")
        x = latents[rows, i]
        if trajectory.get("shared_anchor", False) and active.any():
            _, first, inverse = _first_of_group(group_ids[rows])
            v = velocity(x[first], sigmas[i], rows[first])[inverse.to(x.device)]  # one forward per group
        else:
            v = velocity(x, sigmas[i], None if len(rows) == n else rows)
        out = flow_sde_step(
            v, x, sigmas[i], sigmas[end], noise_level=level, sde_type=trajectory["shared_sde_type"],
            sigma_at_one=sigmas[1], prev_sample=latents[rows, end],
        )
        outs.append(out if len(rows) == n else _scatter(out, rows, n))
    return Score(
        log_prob=torch.stack([o.log_prob for o in outs], dim=1),  # [n, k]
        mean=torch.stack([o.mean for o in outs], dim=1),  # [n, k, ...]
        std=torch.stack([o.std for o in outs], dim=1),  # [n, k, 1, ...]
        noise_scale=torch.stack([o.noise_scale for o in outs], dim=1),  # [n, k, 1, ...]
        mask=torch.stack(masks, dim=1).to(device),  # [n, k]
        old_mean=recorded_means(trajectory, steps, device),  # [n, k, ...] with feature "old_mean", else None
    )


def _first_of_group(ids: torch.Tensor):
    """Unique ids, the position of each id's first occurrence and the inverse index."""
    unique, inverse = torch.unique(ids, return_inverse=True)
    first = torch.stack([torch.nonzero(inverse == u)[0, 0] for u in range(len(unique))])
    return unique, first, inverse


def _scatter(out, rows: torch.Tensor, n: int):
    """The step output for `rows` placed in `n`-row tensors (zeros elsewhere), keeping gradients."""

    def full(value):
        placed = value.new_zeros((n, *value.shape[1:]))
        return placed.index_put((rows.to(value.device),), value)

    return type(out)(
        prev_sample=full(out.prev_sample), log_prob=full(out.log_prob), mean=full(out.mean), std=full(out.std),
        noise_scale=full(out.noise_scale),
    )
