"""Graceful stops: the first SIGINT (Ctrl-C) or SIGTERM (a cluster scheduler's pre-emption) lets the current training
step finish, then the trainer writes a checkpoint and its summary and exits with the conventional code (128 + the
signal number: 130, 143); a second signal stops at once.

During set-up (building the models, the first evaluation and the first step: ``at_once``) there is nothing to save yet,
so the first signal already stops at once: SIGINT as a `KeyboardInterrupt`, SIGTERM with one line on stderr and exit
status 143, no checkpoint written. A stop at once must not wait for the code that is running: Python runs signal
handlers only between bytecodes, so a long native call (a huge allocation, a tensor operation) would delay them. A
watcher thread, woken through `signal.set_wakeup_fd` as the signal arrives, ends the process itself (``os._exit``
with the same status and line) when the main thread has not stopped within ``GRACE_SECONDS``.

On a cluster, ``checkpoint.warning_signal`` adds the early warning a scheduler sends before the time limit (SLURM's
``--signal=USR1@300``: SIGUSR1 five minutes before), handled as SIGTERM: the step finishes, a checkpoint is saved and
the process exits with 128 + its number (138), which the job script can requeue on. ``checkpoint.stop_deadline`` bounds
how long the step may still take after the first signal: past it, the run stops at once as at a second signal (no
checkpoint for that step; the last one is kept), so a long step never runs into the scheduler's kill.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading

SIGNALS = (signal.SIGINT, signal.SIGTERM)
GRACE_SECONDS = 2.0  # how long the watcher lets the main thread stop by itself before ending the process


def stop_signals(warning_signal: str | None) -> tuple[int, ...]:
    """SIGINT, SIGTERM and the configured early-warning signal (``"SIGUSR1"``, ``"USR1"``...), if any."""
    if not warning_signal:
        return SIGNALS
    name = warning_signal.upper()
    extra = signal.Signals[name if name.startswith("SIG") else f"SIG{name}"]
    return SIGNALS if extra in SIGNALS else (*SIGNALS, extra)


class StopSignals:
    """A context that turns SIGINT / SIGTERM into a stop request (see the module docstring).

    Outside the main thread (where Python cannot install handlers) it changes nothing.

    Args:
        announce (`bool`): print the one-line notices (the main process of a multi-process run).
        at_once (`bool`): every signal stops at once (set-up: nothing to save yet); the trainer turns it off once its
            first step has finished.
        signals (`tuple[int, ...]`): the signals handled (default SIGINT and SIGTERM; see [`stop_signals`]).
        deadline (`float`): seconds after the first signal within which the current step must end (the context
            exited); past them the run stops at once, as at a second signal. 0: no deadline.

    Attributes:
        received (`int` or `None`): the first signal's number, once one arrived.
    """

    def __init__(self, announce: bool = True, at_once: bool = False, signals: tuple[int, ...] = SIGNALS,
                 deadline: float = 0.0):
        self.announce = announce
        self.at_once = at_once
        self.signals = tuple(signals)
        self.deadline = deadline
        self._timer: threading.Timer | None = None
        self.received: int | None = None
        self._previous: dict[int, object] = {}
        self._wakeup: tuple[socket.socket, socket.socket, int] | None = None
        self._stopping = threading.Event()  # set when the main thread's handler stops at once
        self._handled = 0  # signals the main thread's handler has run for

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            for signum in self.signals:
                self._previous[signum] = signal.signal(signum, self._handle)
            self._start_watcher()
        return self

    def __exit__(self, *exc) -> None:
        if self._timer is not None:
            self._timer.cancel()  # the step ended within the deadline
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()
        if self._wakeup is not None and threading.current_thread() is threading.main_thread():
            reader, writer, previous = self._wakeup
            self._wakeup = None
            signal.set_wakeup_fd(previous)
            writer.close()
            reader.close()  # the watcher's recv ends

    def _start_watcher(self) -> None:
        """Has the C-level signal handler write each signal's number to a socket that a daemon thread reads."""
        reader, writer = socket.socketpair()
        writer.setblocking(False)
        try:
            previous = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
        except ValueError:  # not the main thread of the main interpreter
            reader.close()
            writer.close()
            return
        self._wakeup = (reader, writer, previous)
        threading.Thread(target=self._watch, args=(reader,), name="mmgrpo-stop-watcher", daemon=True).start()

    def _watch(self, reader: socket.socket) -> None:
        seen = 0
        while True:
            try:
                data = reader.recv(64)
            except OSError:
                return
            if not data:
                return
            for signum in data:
                if signum not in self.signals:
                    continue
                seen += 1
                stop_now = self.at_once or seen > 1
                if stop_now and not self._stopping.wait(GRACE_SECONDS) and self._handled < seen:
                    # the main thread should stop now, but its handler did not run (a long native call): end it here
                    self._say(f"{signal.Signals(signum).name} received: the process did not stop within "
                              f"{GRACE_SECONDS:g} s (a long native call); stopped at once (no checkpoint written).")
                    os._exit(128 + signum)

    def _say(self, text: str) -> None:
        if self.announce:
            print(f"\nmmgrpo: {text}", file=sys.stderr, flush=True)

    def _handle(self, signum: int, frame) -> None:
        self._handled += 1
        if self.at_once and self.received is None:  # set-up: nothing to save yet
            self.received = signum
            self._stopping.set()
            if signum == signal.SIGINT:
                raise KeyboardInterrupt  # `mmgrpo` says "stopped at once" and exits with 130
            self._say(f"{signal.Signals(signum).name} received during set-up: stopped at once (no checkpoint "
                      "written).")
            raise SystemExit(128 + signum)
        if self.received is not None:  # the second signal: stop now, as without this context
            self._stopping.set()
            self.__exit__()
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            signal.raise_signal(signum)
            return
        self.received = signum
        if self.deadline > 0:
            self._timer = threading.Timer(self.deadline, self._deadline_passed, args=(signum,))
            self._timer.daemon = True
            self._timer.start()
        if self.announce:
            limit = f" within {self.deadline:g} s" if self.deadline > 0 else ""
            print(f"\nmmgrpo: {signal.Signals(signum).name} received: finishing this step{limit}, then saving a "
                  "checkpoint (send it again to stop at once).", file=sys.stderr, flush=True)

    def _deadline_passed(self, signum: int) -> None:
        """The step did not end within `deadline` seconds of the first signal: the signal again, as from the user."""
        self._say(f"the step did not finish within {self.deadline:g} s of {signal.Signals(signum).name}: stopping at "
                  "once (no checkpoint for this step; the last one is kept).")
        signal.pthread_kill(threading.main_thread().ident, signum)

    @property
    def name(self) -> str | None:
        """The first signal's name (``"SIGTERM"``...), or None."""
        return None if self.received is None else signal.Signals(self.received).name

    @property
    def exit_code(self) -> int:
        """The shell's convention for a process ended by the first signal: 128 + its number (0 when none came)."""
        return 0 if self.received is None else 128 + self.received
