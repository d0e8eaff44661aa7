"""The update side of a trainer step: optimizer updates on one rollout batch whose advantages are known, under the
skip rules of [`mmgrpo.trainer`]'s docstring (inner epochs, minibatches, gradient accumulation over passes and units,
clipping, NaN-skip, the learning-rate schedule, the algorithm's KL clock and ``after_update`` hook).

The functions read and move forward an [`UpdateRun`]: the trainer's policy, algorithm, optimizer and schedule, its
accelerator and distribution, and its count of updates not taken (``skipped_updates``, checkpointed by the trainer).
"""

from __future__ import annotations

import contextlib
import math
from typing import Protocol

import torch

from . import sharding
from .advantages import kept_samples
from .components import score_unit
from .plans import SamplingPlan
from .run_loop import sum_over_processes


class UpdateRun(Protocol):
    """What the updates read: the run's config, accelerator and distribution (`world` processes, this one's `rank`,
    the `sharding` mode and the `wrapped` trained modules), its policy, algorithm, optimizer and learning-rate schedule;
    and what they move forward: `skipped_updates` and the `weight_ema` of ``train.ema`` (None without it)."""

    config: object
    accelerator: object
    world: int
    rank: int
    sharding: str
    wrapped: list
    policy: object
    algorithm: object
    optimizer: object
    lr_scheduler: object
    weight_ema: object
    skipped_updates: int


def update(run: UpdateRun, rollout, plan: SamplingPlan, advantages, with_signal, generator, rewarded=None) -> dict:
    """Optimizer updates on one rollout batch, under the skip rules of [`mmgrpo.trainer`]'s docstring.

    Args:
        advantages (`torch.FloatTensor` of shape `[n]`, or `[n, S]` under ``traits.step_advantages``): this
            process's slice.
        with_signal (`torch.BoolTensor` of shape `[N]`): whether a sample's group has a non-zero advantage, over
            the global batch, so every process decides alike whether to skip or step.
        rewarded (`torch.BoolTensor` of shape `[N]`, *optional*): whether a sample's reward is finite (default:
            every sample). A sample without a reward is never scored: it adds nothing to the loss, KL included.

    When the algorithm declares ``traits.zero_advantage_is_inert`` (such samples add exactly nothing to its loss's
    gradient, e.g. no KL term), the members of groups without signal are not scored either. Samples not scored
    keep their weight in the minibatch mean, so the gradient is the one of scoring them with advantage 0 and no KL.
    Under ``traits.drop_zero_advantage`` (Flow-GRPO's filter) they leave this process's batch instead: the same
    number of minibatches holds the kept samples only ([`~mmgrpo.advantages.kept_samples`]).
    """
    cfg = run.config.train
    if not plan.train_units:
        return {}
    rewarded = torch.ones_like(with_signal) if rewarded is None else rewarded
    traits = run.algorithm.traits
    scored, takes_update = samples_to_score(traits, with_signal, rewarded)  # [N], bool
    if not takes_update:
        # no reward at all, or nothing but weight decay to apply: no update, and the schedule does not advance
        run.skipped_updates += planned_updates(run, len(rollout))
        return {"train/skipped_updates": run.skipped_updates, "train/unscored_share": 1.0}
    mine = scored[run.rank * len(advantages) : (run.rank + 1) * len(advantages)]  # [n], this process's
    parts = math.ceil(len(rollout) / cfg.minibatch_size)  # minibatches per inner epoch
    kept = kept_samples(advantages, parts, generator) if traits.drop_zero_advantage else None  # Flow-GRPO's filter
    rollout_entries = count_rollout_entries(run, rollout, plan.train_units) if traits.update_mean == "rollout_entries" \
        else None
    passes, grad_norms = [], []  # the loss metrics of each weighted backward pass; the norm of each update
    for _ in range(cfg.inner_epochs):
        minibatches = epoch_minibatches(len(rollout), cfg.minibatch_size, kept, generator)
        per_update = math.ceil(len(minibatches) / cfg.updates_per_step)
        for u in range(0, len(minibatches), per_update):
            group = minibatches[u : u + per_update]
            if not any_scored(run, mine, group):
                run.skipped_updates += 1  # no sample of this update is scored on any process
                continue
            passes += accumulate(run, rollout, plan.train_units, group, mine, advantages, rollout_entries)
            grad_norm = sharding.clip(run.accelerator, run.sharding, run.policy.trainable_parameters(), cfg)
            if not torch.isfinite(torch.as_tensor(grad_norm)):
                run.skipped_updates += 1  # a NaN/inf loss or gradient never reaches the weights
                run.optimizer.zero_grad(set_to_none=True)
                continue
            run.optimizer.step()
            run.lr_scheduler.step()
            run.optimizer.zero_grad(set_to_none=True)
            run.algorithm.kl.step()  # the KL weight counts the updates taken (its schedule's clock)
            if run.weight_ema is not None:  # train.ema: the average of the weights follows the updates taken
                run.weight_ema.after_update(run.policy.trainable_parameters())
            if traits.after_update:
                run.algorithm.after_update(run.policy)  # e.g. DGPO's fast-EMA old model follows the weights
            grad_norms.append(float(grad_norm))
    keys = dict.fromkeys(key for metrics in passes for key in metrics)
    metrics = {f"train/{k}": sum(p.get(k, 0.0) for p in passes) / len(passes) for k in keys}
    if grad_norms:
        metrics["train/grad_norm"] = sum(grad_norms) / len(grad_norms)
    metrics["train/skipped_updates"] = run.skipped_updates
    metrics["train/unscored_share"] = 1.0 - scored.float().mean().item()  # of the global batch
    return metrics


def samples_to_score(traits, with_signal: torch.Tensor, rewarded: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """The samples an update scores and whether the rollout batch gives an update at all (the skip rules of
    [`update`]).

    Args:
        traits: the algorithm's traits (``zero_advantage_is_inert``, ``needs_reference``).
        with_signal, rewarded (`torch.BoolTensor` of shape `[N]`): as for [`update`].

    Returns:
        `(torch.BoolTensor of shape [N], bool)`: the samples to score; False when nothing is rewarded, or when no
        group has signal and the algorithm has no reference term (nothing but weight decay to apply).
    """
    scored = rewarded & with_signal if traits.zero_advantage_is_inert else rewarded  # [N]
    return scored, bool(scored.any()) and bool(with_signal.any() or traits.needs_reference)


def epoch_minibatches(n: int, minibatch_size: int, kept: torch.Tensor | None,
                      generator: torch.Generator | None) -> list[torch.Tensor]:
    """One inner epoch's minibatches of sample indices: a random order of the `n` samples cut into `minibatch_size`
    pieces, or, with `kept` (Flow-GRPO's filter, [`~mmgrpo.advantages.kept_samples`]), the kept samples in a random
    order cut into as many minibatches as the whole batch makes, which shrink."""
    if kept is None:
        return list(torch.randperm(n, generator=generator).split(minibatch_size))
    return list(kept[torch.randperm(len(kept), generator=generator)].tensor_split(math.ceil(n / minibatch_size)))


def planned_updates(run: UpdateRun, n: int) -> int:
    """The optimizer updates a rollout batch of `n` samples per process gives (what a skipped step skips)."""
    cfg = run.config.train
    minibatches = math.ceil(n / cfg.minibatch_size)
    return cfg.inner_epochs * math.ceil(minibatches / math.ceil(minibatches / cfg.updates_per_step))


def any_scored(run: UpdateRun, mine: torch.Tensor, group: list[torch.Tensor]) -> bool:
    """Whether any process scores a sample in the minibatches `group` of one update (`mine` `[n]`)."""
    return sum_over_processes(run.accelerator, float(sum(int(mine[index].sum()) for index in group))) > 0


def accumulate(run: UpdateRun, rollout, units, group, mine, advantages, rollout_entries=None) -> list[dict[str, float]]:
    """Backward passes of one update: each minibatch of `group`, each unit, its scored samples (`mine` `[n]`)
    weighted by their share of the update's samples, or, when ``traits.update_mean`` is ``"entries"`` /
    ``"rollout_entries"``, by the entries the pass's loss averages over, the update's gradient then divided by their
    count over all passes and processes, or by `rollout_entries` ([`mean_over_entries`]). Returns the loss
    metrics of each pass that had weight."""
    acc, passes = run.accelerator, []
    total = sum(len(m) for m in group)
    by_entries, entries = run.algorithm.traits.update_mean in ("entries", "rollout_entries"), 0.0
    for j, index in enumerate(group):
        kept = index[mine[index]]
        weight = len(kept)
        if weight == 0:  # another process scores samples of this update: a zero-weight pass keeps DDP in step
            kept = index[:1]
        sub = rollout.select(kept)
        for k, unit in enumerate(units):
            last = j == len(group) - 1 and k == len(units) - 1
            out = unit_loss(run, sub, unit, advantages[kept])
            with contextlib.ExitStack() as stack:
                if not last:
                    for module in run.wrapped:
                        stack.enter_context(acc.no_sync(module))
                scale = (float(out.entries) if weight else 0.0) if by_entries else weight / total / len(units)
                entries += scale if by_entries else 0.0
                acc.backward(out.loss * scale)
            if weight:
                passes.append(out.metrics)
    if by_entries:
        mean_over_entries(run, entries, rollout_entries)
    return passes


def count_rollout_entries(run: UpdateRun, rollout, units) -> float:
    """The entries of the whole rollout batch per process (``traits.update_mean = "rollout_entries"``): every
    sample's trained decisions, ``Rollout.mask`` over the plan's train `units`, summed over the processes and
    divided by their number."""
    mine = float(sum(int(rollout.mask[:, unit].sum()) for unit in units))
    return sum_over_processes(run.accelerator, mine) / run.world


def mean_over_entries(run: UpdateRun, entries: float, rollout_entries: float | None = None) -> None:
    """Divides the accumulated gradient of an update whose passes were weighted by their entries by the update's
    count of entries per process (the gradient is already averaged over processes), so that every entry of the
    update weighs the same on every process; by `rollout_entries` instead when given (the rollout batch's count
    per process, the same for every update: TRL's ``loss_type="dapo"``)."""
    per_process = sum_over_processes(run.accelerator, entries) / run.world if rollout_entries is None else rollout_entries
    if per_process > 0:
        for parameter in run.policy.trainable_parameters():
            if parameter.grad is not None:
                parameter.grad.div_(per_process)


def unit_loss(run: UpdateRun, sub, unit: list[int], advantages):
    """``algorithm.loss`` of `unit` on the minibatch `sub`, its advantages `[n]` (per step `[n, S]`: the unit's
    columns `[n, k]` are passed)."""
    device = run.accelerator.device
    new, old, ref = score_unit(run.policy, run.algorithm, sub, unit, device)
    if run.algorithm.traits.step_advantages:
        advantages = advantages[:, unit]  # [n, k]
    return run.algorithm.loss(new, old, advantages.to(device), ref)
