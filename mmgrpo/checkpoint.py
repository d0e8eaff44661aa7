"""Atomic, resumable checkpoints.

A checkpoint is a folder ``<output_dir>/checkpoints/step_XXXXXXX`` holding the trainable weights (written by the
policy's ``save_pretrained``), ``optimizer.pt``, ``lr_scheduler.pt``, one ``rng_rank{r}.pt`` per process and
``trainer_state.json``, plus ``algorithm.pt`` when the algorithm has state of its own (``state_dict`` /
``load_state_dict``, e.g. DGPO's fast-EMA old model). It is written under a temporary name and renamed when
complete, so a crash while saving leaves the previous checkpoint intact and loadable.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import numpy as np
import torch

STATE_FILE = "trainer_state.json"
ALGORITHM_FILE = "algorithm.pt"
PREFIX = "step_"


def rng_state() -> dict:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


def complete_checkpoints(root: str | Path) -> list[Path]:
    """Complete checkpoints under `root`, oldest first (temporary folders of interrupted saves are ignored)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.glob(f"{PREFIX}*") if p.is_dir() and not p.name.endswith(".tmp") and (p / STATE_FILE).is_file()]
    return sorted(found, key=lambda p: int(p.name[len(PREFIX):]))


def save(
    accelerator, root: str | Path, step: int, policy, optimizer, lr_scheduler, state: dict, keep_last: int, algorithm=None
) -> Path:
    """Writes checkpoint `step` atomically from every process (rank 0 writes the shared parts)."""
    root = Path(root)
    final = root / f"{PREFIX}{step:07d}"
    tmp = root / f"{PREFIX}{step:07d}.tmp"
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    accelerator.wait_for_everyone()
    torch.save(rng_state(), tmp / f"rng_rank{accelerator.process_index}.pt")
    if accelerator.is_main_process:
        policy.save_pretrained(str(tmp / "weights"))
        torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
        torch.save(lr_scheduler.state_dict(), tmp / "lr_scheduler.pt")
        if hasattr(algorithm, "state_dict"):
            torch.save(algorithm.state_dict(), tmp / ALGORITHM_FILE)
        (tmp / STATE_FILE).write_text(json.dumps({"step": step, **state}, indent=2), encoding="utf-8")
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        for old in complete_checkpoints(root)[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


def resolve(resume_from: str, root: str | Path) -> Path:
    """``"latest"`` -> newest complete checkpoint under `root`; otherwise the given folder, checked."""
    if resume_from == "latest":
        found = complete_checkpoints(root)
        if not found:
            raise FileNotFoundError(f"checkpoint.resume_from=latest but {root} holds no complete checkpoint.")
        return found[-1]
    path = Path(resume_from)
    if not (path / STATE_FILE).is_file():
        raise FileNotFoundError(f"checkpoint.resume_from: {path} is not a complete checkpoint (no {STATE_FILE}).")
    return path


def load(accelerator, path: Path, policy, optimizer, lr_scheduler, algorithm=None) -> dict:
    """Restores weights, optimizer, LR schedule, the algorithm's own state and RNG states; returns the trainer state
    (step, data position)."""
    policy.load_trainable(str(path / "weights"))
    if hasattr(algorithm, "load_state_dict"):
        if not (path / ALGORITHM_FILE).is_file():
            raise FileNotFoundError(f"{path} has no {ALGORITHM_FILE}: it was written by a run of another algorithm.")
        algorithm.load_state_dict(torch.load(path / ALGORITHM_FILE, weights_only=False))
    optimizer.load_state_dict(torch.load(path / "optimizer.pt", weights_only=False))
    lr_scheduler.load_state_dict(torch.load(path / "lr_scheduler.pt", weights_only=False))
    rng_file = path / f"rng_rank{accelerator.process_index}.pt"
    if rng_file.is_file():
        set_rng_state(torch.load(rng_file, weights_only=False))
    return json.loads((path / STATE_FILE).read_text(encoding="utf-8"))
