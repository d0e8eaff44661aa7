"""Graceful stops: the first SIGINT (Ctrl-C) or SIGTERM (a cluster scheduler's pre-emption) lets the current training
step finish, then the trainer writes a checkpoint and its summary and exits with the conventional code (128 + the
signal number: 130, 143); a second signal stops at once."""

from __future__ import annotations

import signal
import sys
import threading

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopSignals:
    """A context that turns SIGINT / SIGTERM into a stop request (see the module docstring).

    Outside the main thread (where Python cannot install handlers) it changes nothing.

    Attributes:
        received (`int` or `None`): the first signal's number, once one arrived.
    """

    def __init__(self, announce: bool = True):
        self.announce = announce
        self.received: int | None = None
        self._previous: dict[int, object] = {}

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            for signum in SIGNALS:
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame) -> None:
        if self.received is not None:  # the second signal: stop now, as without this context
            self.__exit__()
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            signal.raise_signal(signum)
            return
        self.received = signum
        if self.announce:
            print(f"\nmmgrpo: {signal.Signals(signum).name} received: finishing this step, then saving a checkpoint "
                  "(send it again to stop at once).", file=sys.stderr, flush=True)

    @property
    def name(self) -> str | None:
        """The first signal's name (``"SIGTERM"``...), or None."""
        return None if self.received is None else signal.Signals(self.received).name

    @property
    def exit_code(self) -> int:
        """The shell's convention for a process ended by the first signal: 128 + its number (0 when none came)."""
        return 0 if self.received is None else 128 + self.received
