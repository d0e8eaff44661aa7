"""``train.ema``: evaluate, checkpoint and export an exponential moving average of the trained weights, as Flow-GRPO and
DiffusionNFT do with their ``train.ema`` (https://github.com/yifan123/flow_grpo, https://github.com/NVlabs/DiffusionNFT).

After the `u`-th optimizer update taken (``u = 1, 2, ...``), when ``(u + 1) % update_every == 0``, the average takes
one step towards the trained weights `p`::

    d = min((1 + u) / (10 + u), decay)        # a warm-up: the first steps follow the weights closely
    ema <- ema + (1 - d) * (p - ema)

starting from the weights the run starts with. Rollouts sample from the trained weights; every evaluation (its
metrics, sample grids and per-prompt scores) and every checkpoint's ``weights/`` hold the average, so ``mmgrpo eval``,
``mmgrpo export`` and ``checkpoint.keep_best`` see what the run evaluated. The trained weights themselves are kept in
the checkpoint's [`TRAINED_FILE`], with the count of updates, so a resumed run goes on exactly. Differences from the
authors' code: DiffusionNFT steps its average once per optimizer update (``update_every`` 1), as here. Flow-GRPO
(``update_every`` 8) calls its step after every rollout minibatch with the optimizer-update count, so when several
minibatches accumulate into one update the average steps that many times at a due update (twice in its SD3 recipes,
about ``decay ** 2``); here it steps once. Here the average steps only after updates taken (a skipped update moves
neither the weights nor the average).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

import torch

from . import sharding
from .ema import ParameterEMA
from .state_io import load_state
from .validation import ConfigError, check_fields, check_range

TRAINED_FILE = "trained_weights.safetensors"  # a checkpoint's trained weights when its weights/ hold the average
UPDATE_EVERY_LIMIT = 10**6


@dataclass
class EMAConfig:
    """``train.ema``: the moving average of the trained weights that evaluations, checkpoints and exports use.

    Args:
        decay (`float`): the average's decay once warmed up (the authors' 0.9: about the last 10 averaged updates);
            the decay of the `u`-th update is ``min((1 + u) / (10 + u), decay)``.
        update_every (`int`): the average steps after the updates `u` with ``(u + 1) % update_every == 0`` (the
            authors' ``update_step_interval``: 1 in DiffusionNFT, 8 in Flow-GRPO).
    """

    decay: float = 0.9
    update_every: int = 1

    def __post_init__(self):
        check_fields(self)
        check_range("train.ema.decay", self.decay, 0, 1, high_open=True,
                    fix="the authors use 0.9; 0 evaluates the trained weights themselves")
        check_range("train.ema.update_every", self.update_every, 1, UPDATE_EVERY_LIMIT,
                    fix="1 steps the average after every optimizer update")


def warmed_decay(update: int, decay: float) -> float:
    """The decay of the average's step after update `update` (1-based): ``min((1 + u) / (10 + u), decay)``."""
    return min((1 + update) / (10 + update), decay)


class WeightEMA:
    """The average of ``train.ema`` over a policy's trainable parameters (see the module docstring).

    Args:
        config ([`EMAConfig`]): the decay and the update interval.
    """

    def __init__(self, config: EMAConfig):
        self.config = config
        self.average = ParameterEMA()
        self.updates = 0  # optimizer updates taken

    def start(self, parameters) -> None:
        """Starts the average at the current `parameters` (the run's initial weights, in their prepared layout)."""
        self.average.update(parameters, 0.0)

    def after_update(self, parameters) -> None:
        """Counts one optimizer update taken and steps the average towards `parameters` when it is due."""
        self.updates += 1
        if (self.updates + 1) % self.config.update_every == 0:
            self.average.update(parameters, warmed_decay(self.updates, self.config.decay))

    def applied(self, parameters):
        """A context in which `parameters` hold the average (their own values restored on exit, bit for bit); it
        yields their own values (see [`ParameterEMA.swapped`])."""
        return self.average.swapped(parameters)

    def checkpoint_files(self, trained) -> dict[str, dict]:
        """The state file of a checkpoint: the trained weights (full tensors; every process must call it) and the
        update count. Called inside [`applied`], with the trained values it yields (the parameters then hold the
        average, which the checkpoint's ``weights/`` are written from): they stay unchanged until it exits, so they
        are not copied again."""
        return {TRAINED_FILE: {"trained": [sharding.full_tensors(t).cpu() for t in trained], "updates": self.updates}}

    @torch.no_grad()
    def resume(self, path: Path, parameters) -> None:
        """Resumes from checkpoint `path`, whose ``weights/`` (the average) `parameters` hold: they become the
        average, and the parameters take the trained weights of its [`TRAINED_FILE`]. A checkpoint written without
        ``train.ema`` has none: the average starts from its weights."""
        parameters = list(parameters)
        self.average.shadow = [p.detach().clone() for p in parameters]
        if not (path / TRAINED_FILE).is_file():
            return
        state = load_state(path / TRAINED_FILE)
        for param, value in zip(parameters, state["trained"], strict=True):
            param.copy_(sharding.like(value, param))
        self.updates = int(state["updates"])


def refuse_averaged_checkpoint(path: Path) -> None:
    """Refuses to resume, without ``train.ema``, a checkpoint whose ``weights/`` hold an average: training would go on
    from the average instead of the trained weights."""
    if (path / TRAINED_FILE).is_file():
        raise ConfigError(f"checkpoint {path.name} was written with train.ema (its weights/ hold the average, its "
                          f"{TRAINED_FILE} the trained weights): resume it with the same train.ema.")


def applied_or_not(ema: WeightEMA | None, parameters):
    """[`WeightEMA.applied`] when the run has an average, else a context that changes nothing."""
    return contextlib.nullcontext() if ema is None else ema.applied(parameters)
