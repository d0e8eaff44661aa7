"""Metrics to ``<output_dir>/metrics.jsonl`` and TensorBoard (main process only), and the one reader of that file."""

from __future__ import annotations

import json
import os
from pathlib import Path


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
    """Appends one JSON line per record and mirrors scalars to TensorBoard under ``<output_dir>/tensorboard``."""

    def __init__(self, output_dir: str | Path, enabled: bool = True):
        self.enabled = enabled
        self.path = Path(output_dir) / "metrics.jsonl"
        self._writer = None
        if enabled:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(str(Path(output_dir) / "tensorboard"))

    def write(self, step: int, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        with self.path.open("a", encoding="utf-8") as f:
            f.write(json.dumps({"step": step, **metrics}) + "\n")
        for key, value in metrics.items():
            self._writer.add_scalar(key, value, step)
        self._writer.flush()

    def truncate_after(self, step: int) -> None:
        """On resume, drops records of steps after the checkpoint (they will be recomputed) and a torn last line."""
        if not self.enabled or not self.path.is_file():
            return
        kept = [record for record in read_records(self.path) if record["step"] <= step]
        tmp = self.path.with_name(self.path.name + ".tmp")
        with tmp.open("w", encoding="utf-8") as f:  # replaced atomically: a crash here keeps the old log whole
            f.write("".join(json.dumps(record) + "\n" for record in kept))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
