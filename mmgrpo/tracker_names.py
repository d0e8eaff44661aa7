"""Metric names and values as every supported tracker takes them.

``metrics.jsonl`` keeps our names (``eval/accuracy``, ``eval/accuracy/malformed``, ``reward/format``...); the
trackers get [`tracker_metrics`]: only finite numbers (a component that does not apply to a sample batch is NaN, and
one that never applies would otherwise be a NaN series), under [`tracker_name`]s, which every tracker accepts:

- MLflow keeps each metric in a file named by its path (its file store), so no name may also be a folder of another:
  ``eval/accuracy`` and ``eval/accuracy/malformed`` cannot both be logged. Its names allow letters, digits, ``_``,
  ``-``, ``.``, spaces, ``:`` and ``/``, and no ``..`` path part.
- Weights & Biases reserves names that start with ``_``; W&B, TensorBoard and MLflow group panels by the part before
  the first ``/``.
- DVCLive writes a file per metric under the metric's path, as MLflow does.

So a name keeps its first ``/`` (the panel group), its later ``/`` become ``.`` (``eval/accuracy.malformed``), any
other character outside ``[A-Za-z0-9_.-]`` becomes ``_``, and a leading ``_`` or ``.`` is dropped (a part left empty
is ``metric``).
"""

from __future__ import annotations

import math
import re

_OTHER = re.compile(r"[^A-Za-z0-9_.\-]")


def tracker_name(name: str) -> str:
    """The name a tracker logs metric `name` under (see the module docstring)."""
    head, slash, rest = str(name).partition("/")
    parts = [_OTHER.sub("_", part) for part in (head, rest.replace("/", "."))]
    parts = [re.sub(r"\.{2,}", ".", part).lstrip("_.") or "metric" for part in parts]
    return parts[0] + slash + parts[1] if slash else parts[0]


def tracker_metrics(metrics: dict) -> dict[str, float]:
    """The finite numbers of `metrics` (bools and non-numbers left out) under their [`tracker_name`]s."""
    return {tracker_name(key): value for key, value in metrics.items()
            if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)}
