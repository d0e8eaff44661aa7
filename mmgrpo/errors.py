"""Errors a run reports in one line.

``mmgrpo train``, ``mmgrpo eval`` and ``mmgrpo sft`` end with ``mmgrpo: <message>`` on stderr and exit code 1, without
a traceback, when a [`RunError`] reaches them: its message already says what failed and what to do (e.g. the `remote`
reward's `RemoteRewardError` when the reward server stops answering). Any other exception keeps its traceback.
"""

from __future__ import annotations


class RunError(RuntimeError):
    """A failure outside the program's own logic (a service that stopped answering, a refused request) whose message
    names the problem and the fix; the command line prints it on one line and exits with status 1."""
