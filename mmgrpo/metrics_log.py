"""Metrics to ``<output_dir>/metrics.jsonl`` and the run's trackers (main process only), and the one reader of that
file.

The JSON lines are standard JSON: a non-finite value (a NaN reward, an infinite loss) is written as ``null``. Trackers
(TensorBoard by default; see [`mmgrpo.tracking`]) get the same records.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path


def json_safe(value):
    """`value` with every non-finite float replaced by None (``null``), recursively through dicts and lists."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: json_safe(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(item) for item in value]
    return value


def read_records(path: str | Path) -> list[dict]:
    """The records of a ``metrics.jsonl``, in order. A crash can tear the last line (half a record, no newline): an
    unparseable LAST line is skipped; an unparseable line before it is corruption and an error.

    Args:
        path (`str` or `Path`): the JSON-lines file (one JSON object per line; blank lines are ignored).

    Raises:
        `ValueError`: a line other than the last is not a JSON object; the message names the file and line number.
    """
    lines = [(number, line) for number, line in enumerate(
        Path(path).read_text(encoding="utf-8", errors="replace").splitlines(), start=1) if line.strip()]
    records = []
    for index, (number, line) in enumerate(lines):
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        if isinstance(record, dict):
            records.append(record)
        elif index < len(lines) - 1:
            raise ValueError(f"{path}, line {number}: not a JSON record ({line[:60]!r}); only the last line may be "
                             "torn by a crash. Repair or delete that line.")
    return records


class MetricsLog:
    """Appends one JSON line per record and hands the record to the run's trackers.

    Args:
        output_dir (`str` or `Path`): the run's folder (``metrics.jsonl`` goes there).
        enabled (`bool`): False on every process but the main one.
        trackers ([`mmgrpo.tracking.Trackers`], *optional*): where records also go; the trainer attaches them once
            the resumed step is known.
    """

    def __init__(self, output_dir: str | Path, enabled: bool = True, trackers=None):
        self.enabled = enabled
        self.path = Path(output_dir) / "metrics.jsonl"
        self.trackers = trackers

    def write(self, step: int, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        with self.path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(json_safe({"step": step, **metrics}), allow_nan=False) + "\n")
        if self.trackers is not None:
            self.trackers.log(step, metrics)

    def truncate_after(self, step: int) -> None:
        """On resume, drops records of steps after the checkpoint (they will be recomputed) and a torn last line."""
        if not self.enabled or not self.path.is_file():
            return
        kept = [record for record in read_records(self.path) if record["step"] <= step]
        tmp = self.path.with_name(self.path.name + ".tmp")
        with tmp.open("w", encoding="utf-8") as f:  # replaced atomically: a crash here keeps the old log whole
            f.write("".join(json.dumps(json_safe(record), allow_nan=False) + "\n" for record in kept))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)

    def tracker_state(self) -> dict:
        """What a checkpoint keeps so that a resumed run continues the trackers' runs (empty without trackers)."""
        return self.trackers.state() if self.trackers is not None else {}

    def close(self) -> None:
        if self.trackers is not None:
            self.trackers.close()
