"""Which held-out splits an evaluation runs and where each split's files go; read before any model loads (no torch).

A prompt source declares its held-out splits (``eval_splits()``, see [`mmgrpo.protocols.PromptSource`]): ``eval``, the
in-distribution one, and any split it generates by a rule no training item satisfies (``ood``); ``eval.splits``
chooses among them (default: all), and [`mmgrpo.evaluation.evaluate_splits`] evaluates each.
"""

from __future__ import annotations

from pathlib import Path

from .validation import ConfigError

DEFAULT_SPLIT = "eval"  # the in-distribution held-out split, logged under eval/ without its name


def chosen_splits(declared: dict[str, list], names: list[str] | None, source: str) -> dict[str, list]:
    """The held-out splits ``eval.splits`` (`names`, None: every one) chooses among those the prompt source `source`
    `declared` (``eval_splits()``), in the order of `names`.

    Raises:
        [`ConfigError`]: a name the source does not declare (the message lists those it does).
    """
    unknown = [name for name in names or () if name not in declared]
    if unknown:
        raise ConfigError(f"eval.splits: prompt source {source!r} declares no held-out split {unknown[0]!r}; it "
                          f"declares {list(declared)} (see its ood option, if any).")
    return {name: declared[name] for name in (names if names is not None else declared)}


def split_path(root: Path, split: str) -> Path:
    """Where the files of held-out split `split` go under `root` (``eval/``, ``samples/``): `root` itself for
    ``eval``, else ``root/<split>``."""
    return root if split == DEFAULT_SPLIT else root / split
