"""Asynchronous training (``train.async: {max_staleness: k}``): each step's rollout is sampled and rewarded ahead of
the updates, in a worker thread, by a rollout copy of the policy whose weights are `k` steps old.

**Schedule.** Step `t`'s rollout has the prompts, plan and generator of synchronous training (the same per-step seeds)
and is sampled from the weights after step ``v(t) = max(t - 1 - k, 0)`` (0: the initial weights). At the start of
step `t` the trainer holds the weights after step ``t - 1``: it snapshots its trainable weights and queues step
``t + k``'s production with them, takes step `t`'s rollout (queued `k` steps earlier) and updates on it while the
worker samples and rewards step ``t + k``. The step ends once both are done, so evaluation, checkpoints and logging
never run beside a production. Once warmed up every rollout is exactly `k` steps stale whatever the timing: runs are
reproducible, and ``k = 0`` (queued and taken at once, through the same copy) gives the metrics of synchronous
training bit for bit. The worker runs ``engine.sample`` and the reward's per-sample call; the reward's group stage,
the gathers, the advantages and the updates run in the trainer's thread as in synchronous training.

**Rollout copy.** The policy is deep-copied before it is prepared, its frozen parameters shared rather than copied (a
LoRA copy costs its adapters; a fully fine-tuned one the trained module once more), moved to the device without a
distribution wrapper, and sampled through ``trainer.engine``, which is built over the copy. Before each production
the copy takes its version's snapshot and the engine ``sync_weights`` from it (nothing to do for the local engine).
Sampling runs under the run's autocast, as the prepared policy's forward does, and without gradients (the copy is never
trained).

**Staleness correction.** The rollout's ``old_log_probs`` are the rollout copy's. An algorithm whose old policy is
the rollout's (``traits.old_source == "rollout"``) takes the ratio ``pi_theta / pi_rollout`` and clips it as its
loss does. With ``k > 0``, an algorithm with a rollout correction (``algorithm.rollout_correction``: ``grpo``,
``dr_grpo``, ``dapo``) gets the stale log-probs as engine log-probs ([`mmgrpo.rollout_correction`]): ``recompute``
makes the old log-probs the current weights' (the ratio starts at 1), ``*_truncate`` / ``*_mask`` weigh each token by
``pi_current / pi_rollout``, the rejection modes drop what lies beyond their bounds. An algorithm whose old policy is
the current one or its own old model (``old_source`` ``"current"`` / ``"old_model"``) treats the rollout as its own.

**Checkpoints.** After step `t` the productions of steps ``t + 1 .. t + k`` are done and not yet trained on. A
checkpoint stores the weight versions they were sampled from (``rollout_weights.safetensors``: the trainable weights
of each version, by version, pickle-free) and the prompt stream as it was before step ``t + 1``'s batch was drawn (what
synchronous training stores). A resumed run produces those steps again from the stored versions with the same seeds,
so it goes on exactly as a run that was never stopped, also after a ``kill -9`` (from the last complete checkpoint).

**Processes.** Under torchrun every process runs its own worker for its own slice of each step; no collective runs in
a worker. ``train.sharding: fsdp`` / ``hybrid`` are refused (the copy needs the whole weights on each process), as are
prompt sampling that reads the previous steps' rewards and, with ``k > 0``, an algorithm whose ``schedule`` reads its
own state (``traits.schedule_reads_state``: MixGRPO's progressive window). Sampling and rewards release the GIL in
their torch ops, so on CPUs the worker's sampling runs beside the updates. On a GPU both threads queue their kernels
on the device's current stream: what overlaps is host-side work (kernel launches, Python, a CPU reward or a reward
server), not the kernels themselves. The worker draws from no global random number generator (sampling uses the
step's generator).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from . import registry
from .errors import RunError
from .plans import SamplingPlan
from .state_io import load_state
from .types import PromptBatch, RewardResult, Rollout
from .validation import ConfigError

WEIGHTS_FILE = "rollout_weights.safetensors"  # in a checkpoint: the weight versions of the rollouts in flight
_SMALL = 256  # containers walked when looking for a policy's modules (a tokenizer's vocabulary is not walked)


@dataclass
class StepInputs:
    """What one step samples: its prompts (`batch` `[N]`, the whole step's; `local` `[n]`, this process's slice), its
    sampling `plan` and the `generator` its sampling and then its updates draw from."""

    step: int
    batch: PromptBatch
    local: PromptBatch
    plan: SamplingPlan
    generator: torch.Generator


@dataclass
class Scored:
    """A step's reward result, computed during its production, read as the trainer reads a pending one
    ([`~mmgrpo.overlapped_scoring.PendingScores`]): `exposed_s` is the reward time that did not overlap sampling in
    the worker (the production's own ``exposed_s``)."""

    value: RewardResult
    exposed_s: float = 0.0

    def result(self) -> RewardResult:
        return self.value


@dataclass
class _Queued:
    inputs: StepInputs
    version: int  # the step whose weights sample it
    weights: list[torch.Tensor]  # those trainable weights, in ``trainable_parameters()`` order
    stream_state: dict  # the prompt stream before this step's batch was drawn
    future: Future  # -> (Rollout, Scored `[n]`)


def check_schedule(config) -> None:
    """Refuses ``train.async`` with a staleness above 0 for an algorithm whose plan depends on the steps before
    (``traits.schedule_reads_state``), before any model loads."""
    options = config.train.async_
    if options is None or options.max_staleness == 0:
        return
    algorithm = registry.get("algorithm", config.algorithm.name)(config.algorithm.options)
    refuse_stale_schedule(options.max_staleness, config.algorithm.name, algorithm.traits)


def refuse_stale_schedule(staleness: int, algorithm_name: str, traits) -> None:
    """Raises when rollouts `staleness` steps ahead cannot be planned: the algorithm's plan depends on the steps before
    (``traits.schedule_reads_state``). [`check_schedule`] calls it before any model loads; the trainer once more with
    its built algorithm (a `Trainer` built without preflight)."""
    if staleness and traits.schedule_reads_state:
        raise ConfigError(f"train.async.max_staleness {staleness}: algorithm {algorithm_name!r} plans each step from "
                          "the steps before it, so no step can be sampled ahead: use max_staleness 0, leave "
                          "train.async out, or choose a schedule that reads no state (MixGRPO: "
                          "algorithm.sample_strategy: random).")


def frozen_parameters(policy) -> dict[int, torch.nn.Parameter]:
    """The frozen parameters of every module reachable from `policy` through attributes and small containers, by id:
    the ``copy.deepcopy`` memo under which a copy shares them."""
    memo, seen, todo = {}, set(), [policy]
    while todo:
        value = todo.pop()
        if id(value) in seen or isinstance(value, (str, bytes, int, float, bool, torch.Tensor)) or value is None:
            continue
        seen.add(id(value))
        if isinstance(value, torch.nn.Module):
            memo.update({id(p): p for p in value.parameters() if not p.requires_grad})
        elif isinstance(value, (list, tuple, set, frozenset)) and len(value) <= _SMALL:
            todo.extend(value)
        elif isinstance(value, dict) and len(value) <= _SMALL:
            todo.extend(value.values())
        else:
            try:
                todo.extend(vars(value).values())
            except TypeError:  # no __dict__ (a builtin, a compiled tokenizer)
                continue
    return memo


def rollout_copy(policy):
    """A copy of `policy` (not prepared yet) that samples the rollouts: its trainable weights its own, its frozen
    parameters `policy`'s."""
    return copy.deepcopy(policy, frozen_parameters(policy))


class _CopyAccelerator:
    """The accelerator as the rollout copy's ``prepare`` sees it: the device, and modules moved there unwrapped (the
    copy samples in one process and is never trained, so it needs no DDP wrapper)."""

    def __init__(self, device: torch.device):
        self.device = device

    def prepare_model(self, module: torch.nn.Module, *args, **kwargs) -> torch.nn.Module:
        return module.to(self.device)

    def prepare_frozen(self, module: torch.nn.Module) -> torch.nn.Module:
        return module.to(self.device)

    def autocast(self):
        """No context of its own: the worker samples under the run's autocast (see [`AsyncRollouts`])."""
        return contextlib.nullcontext()


def snapshot(policy) -> list[torch.Tensor]:
    """The current trainable weights of `policy`, copied, in ``trainable_parameters()`` order."""
    return [p.detach().clone() for p in policy.trainable_parameters()]


class AsyncRollouts:
    """Produces each step's rollout ahead of its updates (see the module docstring).

    Args:
        staleness (`int`): ``train.async.max_staleness``, `k`.
        produce (`Callable`): ``StepInputs -> (Rollout, pending scores)``, the step's sampling through the engine and
            the reward's per-sample call (its ``result()`` waited for in the worker).
        policy: the trained policy (prepared); its weights are snapshotted at the start of each step.
        rollout_policy: the copy made by [`rollout_copy`] (not prepared; prepared here on `accelerator`'s device).
        engine ([`~mmgrpo.engines.RolloutEngine`]): the engine over `rollout_policy`.
        algorithm: the run's algorithm (its rollout correction receives the stale log-probs).
        accelerator: the run's accelerator (device and autocast).
        max_steps (`int`): no step beyond it is produced.
    """

    def __init__(self, staleness: int, produce: Callable[[StepInputs], tuple], policy,
                 rollout_policy, engine, algorithm, accelerator, max_steps: int):
        self.staleness, self.produce, self.max_steps = staleness, produce, max_steps
        self.policy, self.rollout_policy, self.engine, self.algorithm = policy, rollout_policy, engine, algorithm
        self.autocast = accelerator.autocast
        rollout_policy.prepare(_CopyAccelerator(accelerator.device))
        self.queued: dict[int, _Queued] = {}  # step -> its production, until the step takes it
        self.versions: dict[int, list[torch.Tensor]] = {}  # weight versions a resumed run reads from its checkpoint
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mmgrpo-rollouts")

    def version(self, step: int) -> int:
        """The step whose weights sample step `step`'s rollout (0: the initial weights)."""
        return max(step - 1 - self.staleness, 0)

    def take(self, step: int, inputs_of: Callable[[int], StepInputs], stream) -> tuple[StepInputs, Rollout, Scored]:
        """Queues the productions of steps ``step .. step + k`` not queued yet (``inputs_of(s)`` draws step `s`'s
        batch from the prompt `stream`), then waits for step `step`'s and returns its inputs, rollout (its old
        log-probs the rollout copy's; handed to the rollout correction as engine log-probs when ``k > 0``) and the
        reward's per-sample result `[n]` ([`Scored`]). Called at the start of step `step`, before its updates."""
        current = None
        for s in range(step, min(step + self.staleness, self.max_steps) + 1):
            if s in self.queued:
                continue
            version = self.version(s)
            if version == step - 1:
                current = current or snapshot(self.policy)  # the weights after step `step - 1`: the trainer's now
                weights = current
            elif version in self.versions:
                weights = self.versions[version]
            else:
                raise RunError(f"step {s} samples from the weights after step {version}, which the checkpoint does not "
                               "hold (it was written without train.async, or with a smaller max_staleness): resume "
                               "with the train.async settings the checkpoint was written with.")
            state = stream.state_dict()  # before this step's batch is drawn
            inputs = inputs_of(s)
            self.queued[s] = _Queued(inputs, version, weights, state, self.worker.submit(self._produce, inputs, weights))
        self.versions = {}  # every production a resume needed is queued
        entry = self.queued.pop(step)
        rollout, scores = entry.future.result()
        if self.staleness and self.algorithm.traits.rollout_correction is not None and rollout.engine_log_probs is None:
            rollout = dataclasses.replace(rollout, engine_log_probs=rollout.old_log_probs)  # [n, S] pi_rollout's
        return entry.inputs, rollout, scores

    @torch.no_grad()
    def _load(self, weights: list[torch.Tensor]) -> None:
        for target, value in zip(self.rollout_policy.trainable_parameters(), weights, strict=True):
            target.copy_(value)

    def _produce(self, inputs: StepInputs, weights: list[torch.Tensor]) -> tuple[Rollout, Scored]:
        """In the worker: the copy takes the version's weights, then samples and rewards the step."""
        self._load(weights)
        self.engine.sync_weights(self.rollout_policy)
        with self.autocast(), torch.no_grad():  # the copy is never trained: no graph is kept for an update
            rollout, pending = self.produce(inputs)
            scores = pending.result()  # the reward done within the production
        return rollout, Scored(scores, pending.exposed_s)

    def settle(self) -> None:
        """Waits until every queued production is done (a production's error is raised here)."""
        for entry in self.queued.values():
            entry.future.result()

    def stream_state(self, stream) -> dict:
        """The prompt stream's state a checkpoint stores: before the batch of the first step not trained on yet."""
        return self.queued[min(self.queued)].stream_state if self.queued else stream.state_dict()

    def checkpoint_files(self) -> dict[str, dict]:
        """The state file of a checkpoint ([`WEIGHTS_FILE`]): the weight versions of the queued productions."""
        versions = {str(entry.version): entry.weights for entry in self.queued.values()}
        return {WEIGHTS_FILE: {"versions": versions}} if versions else {}

    def load(self, path: Path) -> None:
        """Reads the weight versions of checkpoint `path` (none when it holds no file: nothing was in flight)."""
        if not (path / WEIGHTS_FILE).is_file():
            return
        device = self.policy.trainable_parameters()[0].device
        versions = load_state(path / WEIGHTS_FILE)["versions"]
        self.versions = {int(v): [w.to(device) for w in weights] for v, weights in versions.items()}

    def close(self) -> None:
        """Waits for the worker and ends it."""
        self.worker.shutdown(wait=True, cancel_futures=True)
