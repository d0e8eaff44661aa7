"""The progress of a run's training steps on the main process: a tqdm bar on a terminal; plain lines when the output
is not a terminal (a log file, a cluster job's output), at most one every ``PLAIN_EVERY_SECONDS`` (and at the first
and last step), so a log holds readable lines instead of a flood of carriage-return updates.

With a time budget (``train.max_seconds``), the total and the estimated time left are those of the budget when it ends
the run first: the steps still to run are those the budget leaves at the mean training time per step so far (only the
time of training steps counts, as for the budget itself).
"""

from __future__ import annotations

import math
import sys
import time

PLAIN_EVERY_SECONDS = 30.0  # the least time between two plain progress lines


def _clock(seconds: float) -> str:
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60:02d}:{rest % 60:02d}"


class StepProgress:
    """Shows steps ``start + 1 ... max_steps`` of a run (see the module docstring).

    Args:
        start (`int`): the step the run starts after (a resumed run's checkpoint step).
        max_steps (`int`), max_seconds (`float`): the run's limits (``train.max_steps``, ``train.max_seconds``; 0:
            none).
        start_seconds (`float`): the training time already spent (a resumed run's).
        desc (`str`): the name shown (``"train"``, ``"sft"``).
        enabled (`bool`): False on every process but the main one (nothing is shown).
        stream (file, *optional*): where to write (default: standard error, where tqdm writes).
        every_seconds (`float`): the least time between two plain lines.
        clock (callable): the wall clock of the plain lines (``time.monotonic``).
    """

    def __init__(self, start: int, max_steps: int, max_seconds: float, start_seconds: float, desc: str,
                 enabled: bool = True, stream=None, every_seconds: float = PLAIN_EVERY_SECONDS, clock=time.monotonic):
        self.start, self.max_steps, self.max_seconds = start, max_steps, max_seconds
        self.start_seconds, self.desc, self.enabled = start_seconds, desc, enabled
        self.stream = stream or sys.stderr
        self.every_seconds, self.clock = every_seconds, clock
        self.plain = enabled and not self.stream.isatty()
        self.last_line: float | None = None
        self.bar = None
        if enabled and not self.plain:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=max_steps, initial=start, desc=desc, file=self.stream, dynamic_ncols=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()

    def expected(self, step: int, train_seconds: float) -> tuple[int, float | None]:
        """``(total steps, training seconds left)`` after `step` with `train_seconds` spent: the budget's when it ends
        the run before ``max_steps`` (None: no estimate yet)."""
        done = step - self.start
        if done <= 0:
            return self.max_steps, None
        per_step = max(train_seconds - self.start_seconds, 0.0) / done
        left = (self.max_steps - step) * per_step
        if self.max_seconds <= 0:
            return self.max_steps, left
        budget_left = max(self.max_seconds - train_seconds, 0.0)
        affordable = step + (math.ceil(budget_left / per_step) if per_step > 0 else self.max_steps)
        return min(self.max_steps, affordable), min(left, budget_left)

    def update(self, step: int, train_seconds: float, postfix: dict[str, str], last: bool = False) -> None:
        """Step `step` is done, `train_seconds` of training spent in all; `postfix` the values to show; `last`: the
        run stops after it."""
        if not self.enabled:
            return
        total, left = self.expected(step, train_seconds)
        if self.bar is not None:
            self.bar.total = step if last else total
            self.bar.update(step - self.bar.n)
            self.bar.set_postfix(postfix)
            return
        now = self.clock()
        if not (last or self.last_line is None or now - self.last_line >= self.every_seconds):
            return
        self.last_line = now
        values = " ".join(f"{key} {value}" for key, value in postfix.items())
        eta = "" if left is None or last else f", about {_clock(left)} of training left"
        print(f"{self.desc}: step {step}/{step if last else total} {values} ({_clock(train_seconds)} of training"
              f"{eta})", file=self.stream, flush=True)


def quiet_library_bars(stream=None) -> bool:
    """Turns off the loading and download bars of diffusers, transformers and huggingface_hub when `stream` (default:
    standard error) is not a terminal, so a log file holds no carriage-return updates from them either. Returns
    whether it did."""
    if (stream or sys.stderr).isatty():
        return False
    import diffusers.utils.logging
    import huggingface_hub.utils
    import transformers.utils.logging

    diffusers.utils.logging.disable_progress_bar()
    transformers.utils.logging.disable_progress_bar()
    huggingface_hub.utils.disable_progress_bars()
    return True
