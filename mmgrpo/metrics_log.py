"""Metrics to ``<output_dir>/metrics.jsonl`` and TensorBoard (main process only)."""

from __future__ import annotations

import json
from pathlib import Path


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
        """On resume, drops records of steps after the checkpoint (they will be recomputed)."""
        if not self.enabled or not self.path.is_file():
            return
        lines = [line for line in self.path.read_text(encoding="utf-8").splitlines() if line.strip()]
        kept = [line for line in lines if json.loads(line)["step"] <= step]
        self.path.write_text("".join(line + "\n" for line in kept), encoding="utf-8")

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
