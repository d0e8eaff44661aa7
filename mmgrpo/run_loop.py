"""The outer loop that `mmgrpo train` ([`~mmgrpo.trainer.Trainer`]) and `mmgrpo sft` ([`~mmgrpo.sft.SFTTrainer`])
share: steps until ``train.max_steps`` or ``train.max_seconds``, the held-out evaluation before the first step, at
``eval.every`` / ``eval.every_seconds`` and after the last, the metrics log, periodic checkpoints and the stop signals.

Per step: [`timed_step`] runs the run's ``train_step`` and adds its wall-clock time (the slowest process's, so every
process agrees on the budget) to ``train_seconds``; evaluation, logging and checkpoints come after it and do not count.
A SIGINT / SIGTERM stops at once until the first step has finished (there is nothing to save), then finishes the step
and stops every process together (see [`~mmgrpo.stop_signals.StopSignals`]). The caller saves and summarises.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Protocol

import torch

from . import sharding
from .evaluation import evaluation_due
from .progress import StepProgress
from .stop_signals import StopSignals, stop_signals
from .tracking import accelerator_options


def make_accelerator(config):
    """An `Accelerator` that also works on CPU-only machines under torchrun (accelerate needs ``cpu=True`` there)."""
    from accelerate import Accelerator

    # step_scheduler_with_optimizer=False: the schedule counts optimizer updates, which are global (one per update on
    # every rank); accelerate's default would step it once per process, i.e. world-size times too fast.
    return Accelerator(
        cpu=not torch.cuda.is_available(),
        mixed_precision=sharding.autocast_precision(config.train),  # "no" under FSDP2: its own mixed precision
        step_scheduler_with_optimizer=False,
        **accelerator_options(config, Path(config.output_dir)),  # trackers (tracking.log_with) and their folder
    )


def gathered(accelerator, value: float) -> torch.Tensor:
    """`value` of every process `[world]` (float64), in rank order."""
    value = torch.tensor([value], dtype=torch.float64)
    return value if accelerator.num_processes == 1 else accelerator.gather(value.to(accelerator.device)).cpu()


def sum_over_processes(accelerator, value: float) -> float:
    """The sum of `value` over every process (every process calls it, in the same order)."""
    return float(gathered(accelerator, value).sum())


def max_over_processes(accelerator, value: float) -> float:
    """The largest `value` over every process."""
    return float(gathered(accelerator, value).max())


class LoopRun(Protocol):
    """What the loop reads and moves forward: the run's config, accelerator and metrics log, its position (`step`,
    `train_seconds` spent in training steps, `eval_mark`: `train_seconds` at the last evaluation) and its step,
    evaluation and checkpoint."""

    config: object
    accelerator: object
    log: object
    step: int
    train_seconds: float
    eval_mark: float

    def train_step(self) -> dict[str, float]: ...

    def evaluate(self, step: int) -> dict[str, float]: ...

    def save(self): ...


def timed_step(run: LoopRun) -> dict[str, float]:
    """``run.train_step()`` plus its wall-clock time (``time/step_s``, the slowest process's) and the running total of
    training time (``time/train_s``, what ``train.max_seconds`` limits)."""
    start = time.perf_counter()
    metrics = run.train_step()
    elapsed = max_over_processes(run.accelerator, time.perf_counter() - start)
    run.train_seconds += elapsed
    metrics["time/step_s"] = elapsed
    metrics["time/train_s"] = run.train_seconds
    return metrics


def run_steps(run: LoopRun, desc: str, postfix: tuple[str, str]) -> str | None:
    """Runs the remaining steps of `run` (see the module docstring) with a progress bar named `desc` showing
    `postfix` ``(label, metric)``; returns the name of the signal that stopped it, or None."""
    cfg, main = run.config, run.accelerator.is_main_process
    evaluating = bool(cfg.eval.every or cfg.eval.every_seconds)
    stopped_by = None
    signals = stop_signals(cfg.checkpoint.warning_signal)  # SIGINT, SIGTERM and a scheduler's early warning
    with StopSignals(main, True, signals, cfg.checkpoint.stop_deadline) as stop:  # at once until the first step ends
        if run.step == 0 and evaluating:
            run.log.write(0, run.evaluate(0))
        bar = StepProgress(run.step, cfg.train.max_steps, cfg.train.max_seconds, run.train_seconds, desc, main)
        for _ in range(run.step, cfg.train.max_steps):
            run.step += 1
            metrics = timed_step(run)
            stop.at_once = False
            out_of_time = 0 < cfg.train.max_seconds <= run.train_seconds
            last = out_of_time or run.step == cfg.train.max_steps
            if evaluating and (last or evaluation_due(cfg.eval.every, cfg.eval.every_seconds, run.step,
                                                      run.train_seconds, run.eval_mark)):
                metrics.update(run.evaluate(run.step))
                run.eval_mark = run.train_seconds
            if run.step % cfg.log_every == 0 or last or any(k.startswith("eval/") for k in metrics):
                run.log.write(run.step, metrics)
            bar.update(run.step, run.train_seconds, {postfix[0]: f"{metrics[postfix[1]]:.4g}"}, last)
            if cfg.checkpoint.every and run.step % cfg.checkpoint.every == 0:
                run.save()
            if out_of_time:
                break  # train.max_seconds spent: the last step was evaluated above; the caller saves it
            if sum_over_processes(run.accelerator, float(stop.received is not None)) > 0:  # every process stops
                stopped_by = stop.name or "SIGTERM"  # the signal may have reached another process only
                break
        bar.close()
    return stopped_by
