"""``checkpoint.keep_best: METRIC``: besides the newest ``checkpoint.keep_last`` checkpoints, the run keeps the one
whose evaluation scored best on `METRIC` (an evaluation metric as ``metrics.jsonl`` names it, e.g. ``eval/score`` or
``eval/pickscore/score`` of an ``eval.rewards`` entry), in ``<output_dir>/checkpoints/best/step_XXXXXXX``.

After every evaluation of a training run, a finite value better than the best so far (higher, or lower with
``checkpoint.keep_best_mode: min``; a tie keeps the earlier one) saves a whole checkpoint there, written as every
checkpoint is ([`mmgrpo.checkpoint.save`]: atomic, pickle-free, resumable); the previous best is deleted only once the
new one is complete. Its ``trainer_state.json`` records ``best: {metric, value}``, so a resumed run knows the best so
far (from a best checkpoint of a step at or before the one it resumes from; one written later, by a run that went
further before it was stopped, is replaced at the next improvement). ``summary.json`` names it: ``best_checkpoint``,
``best_step`` and ``best_value``. ``mmgrpo eval`` never writes one.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Callable

from . import checkpoint
from .errors import RunError

FOLDER = "best"


class BestCheckpoint:
    """Keeps the best evaluated checkpoint of a run (see the module docstring).

    Args:
        metric (`str`, *optional*): ``checkpoint.keep_best``; None keeps nothing.
        mode (`str`): ``"max"`` or ``"min"`` (``checkpoint.keep_best_mode``).
        root (`Path`): the run's checkpoint folder; the best is kept in ``root / "best"``.
        step (`int`): the run's step (after a resume), to recover the best so far.
    """

    def __init__(self, metric: str | None, mode: str, root: Path, step: int):
        self.metric, self.mode, self.root = metric, mode, Path(root) / FOLDER
        self.value: float | None = None
        self.step: int | None = None
        self.path: Path | None = None
        found = checkpoint.complete_checkpoints(self.root) if metric else []
        meta = checkpoint.read_metadata(found[-1]) if found else None
        best = meta.get("best") if meta else None
        if isinstance(best, dict) and best.get("metric") == metric and meta["step"] <= step and \
                isinstance(best.get("value"), (int, float)) and math.isfinite(best["value"]):
            self.value, self.step, self.path = float(best["value"]), meta["step"], found[-1]

    def better(self, value: float) -> bool:
        """Whether `value` beats the best so far (any finite value does when there is none)."""
        if not math.isfinite(value):
            return False
        return self.value is None or (value > self.value if self.mode == "max" else value < self.value)

    def observe(self, metrics: dict[str, float], step: int, save: Callable[[Path, dict], Path]) -> None:
        """Reads `metrics` of the evaluation at `step` and, on an improvement, calls ``save(folder, state)`` to write
        the checkpoint into ``folder`` with ``state`` added to its ``trainer_state.json`` (every process calls it: the
        metrics are the same on all).

        Raises:
            `RunError`: `metrics` has no such metric (the message lists those it has).
        """
        if not self.metric:
            return
        if self.metric not in metrics:
            raise RunError(f"checkpoint.keep_best: {self.metric} is not among the evaluation's metrics "
                           f"({', '.join(sorted(metrics))}): name one of them.")
        value = float(metrics[self.metric])
        if self.better(value):
            self.path = save(self.root, {"best": {"metric": self.metric, "value": value}})
            self.value, self.step = value, step

    def summary(self) -> dict:
        """What ``summary.json`` says of it: ``best_checkpoint``, ``best_step``, ``best_value`` (empty without one)."""
        if self.path is None:
            return {}
        return {"best_checkpoint": str(self.path), "best_step": self.step, "best_value": self.value}
