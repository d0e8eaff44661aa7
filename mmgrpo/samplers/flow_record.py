"""The transition means a flow rollout records for plans with feature ``"old_mean"`` (``FlowPlan.record_mean``):
the sampling policy's mean of every trained SDE transition, which [`~mmgrpo.samplers.flow_plan.replay_plan`] returns
as ``Score.old_mean`` (GRPO-Guard's RatioNorm, Flow-DPPO's divergence mask). Only trained steps are kept: the
trajectory's ``old_means`` is `[N, T, ...]` over the `T` steps of [`mean_steps`], ``shared_mean_steps`` names them.
"""

from __future__ import annotations

import torch

from mmgrpo.plans import FlowPlan


def mean_steps(plan: FlowPlan) -> list[int]:
    """The steps whose transition means a plan with `record_mean` records: its trained steps, ascending (column `c`
    of ``old_means`` is step ``mean_steps(plan)[c]``)."""
    return sorted(set(plan.trained_steps))


def recorded_means(trajectory: dict, steps: list[int], device: torch.device) -> torch.Tensor | None:
    """The recorded sampling means of `steps`, `[n, k, ...]`, or `None` when the rollout recorded none (a plan
    without feature ``"old_mean"``)."""
    if "old_means" not in trajectory:
        return None
    recorded = trajectory["shared_mean_steps"]
    missing = [i for i in steps if i not in recorded]
    if missing:
        raise ValueError(f"Steps {missing} were not trained by the rollout's plan, which recorded the means of steps "
                         f"{recorded} only.")
    return trajectory["old_means"][:, [recorded.index(i) for i in steps]].to(device)


def recorded(plan: FlowPlan, means: list[torch.Tensor]) -> dict:
    """The trajectory entries of a plain rollout's recorded means (each `[N, ...]`, in [`mean_steps`] order): none
    without `record_mean`."""
    return dict(old_means=torch.stack(means, dim=1), shared_mean_steps=mean_steps(plan)) if plan.record_mean else {}


def path_state(plan: FlowPlan, n: int, x: torch.Tensor) -> dict:
    """The per-sample paths' recording state (``means`` `[N, T, ...]`, zero where a sample does not take the step, and
    their steps): none without `record_mean`."""
    if not plan.record_mean:
        return {}
    return dict(means=torch.zeros(n, len(mean_steps(plan)), *x.shape[1:], device=x.device), mean_steps=mean_steps(plan))


def record_path_step(state: dict, rows: torch.Tensor, i: int, level: float, mean: torch.Tensor) -> None:
    """Records the means `[r, ...]` of step `i` taken by samples `rows`, when recording and the step is stochastic."""
    if "means" in state and level > 0 and i in state["mean_steps"]:
        state["means"][rows, state["mean_steps"].index(i)] = mean.to(state["means"].device)


def path_recorded(state: dict) -> dict:
    """The trajectory entries of the per-sample paths' recorded means (none without recording)."""
    return dict(old_means=state["means"], shared_mean_steps=state["mean_steps"]) if "means" in state else {}
