"""Prompts from a text file (one per line) or a JSONL file (``{"prompt": ..., "metadata": {...}}`` per line)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from mmgrpo.validation import check_fields


@dataclass
class PromptFileConfig:
    """Options of [`PromptFile`].

    Args:
        train_file (`str`): ``.txt`` (one prompt per line) or ``.jsonl`` file of training prompts.
        eval_file (`str`, *optional*): held-out prompts in the same format (default: none).
    """

    train_file: str
    eval_file: str | None = None

    def __post_init__(self):
        check_fields(self)
        for key, value in {"train_file": self.train_file, "eval_file": self.eval_file}.items():
            if value is None:
                continue
            path = Path(value).expanduser()
            if not path.is_file():
                raise ValueError(f"data.{key}: {value!r} does not exist; give a .txt or .jsonl prompt file.")
            try:
                items = read_items(path)
            except ValueError as err:  # not UTF-8, a line that is not JSON
                raise ValueError(f"data.{key}: {value!r} is not a valid prompt file: {err}") from None
            if not items:
                raise ValueError(f"data.{key}: {value!r} holds no prompt; add one prompt per line.")


def read_items(path: Path) -> list[dict]:
    """Reads prompt items from `path`; blank lines are skipped."""
    lines = [line.strip() for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    if path.suffix == ".jsonl":
        items = []
        for number, line in enumerate(lines, 1):
            item = json.loads(line)
            if "prompt" not in item:
                raise ValueError(f"{path}:{number}: a JSONL prompt item needs a 'prompt' key.")
            items.append(item)
        return items
    return [{"prompt": line, "metadata": {}} for line in lines]


class PromptFile:
    """A prompt source read from files."""

    Config = PromptFileConfig
    disjoint_splits = False  # the user's files decide (an example config evaluates on its training file)

    def __init__(self, config: PromptFileConfig):
        self.config = config

    def train_items(self) -> list[dict]:
        return read_items(Path(self.config.train_file).expanduser())

    def eval_items(self) -> list[dict]:
        return read_items(Path(self.config.eval_file).expanduser()) if self.config.eval_file else []

    def eval_splits(self) -> dict[str, list[dict]]:
        return {"eval": self.eval_items()}  # one held-out split


PLUGIN = PromptFile
