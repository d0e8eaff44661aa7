"""Imports a script of the repository's `bench/` or `scripts/` folders (folders of scripts, not packages) as a module."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def load_repo_script(folder: str, name: str):
    """The module of ``<repository>/<folder>/<name>.py``, e.g. ``load_repo_script("scripts", "train_vlm_seg")``."""
    spec = importlib.util.spec_from_file_location(name, ROOT / folder / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
