"""Atomic, resumable checkpoints that hold no pickles.

A checkpoint is a folder ``<output_dir>/checkpoints/step_XXXXXXX`` holding the trainable weights (``weights/``,
written by the policy's ``save_pretrained`` as safetensors), ``optimizer.safetensors``, ``lr_scheduler.safetensors``,
one ``rng_rank{r}.safetensors`` per process, ``algorithm.safetensors`` when the algorithm has state of its own
(``state_dict`` / ``load_state_dict``, e.g. DGPO's fast-EMA old model) and ``trainer_state.json`` (the step, the
format of the state files, the mmgrpo version that wrote them, the KL weight's update count). Each state file is
written by [`~mmgrpo.state_io.save_state`]: tensors as safetensors, everything else as JSON, nothing that can carry
code. The folder is written under a temporary name and renamed when complete, so a crash while saving leaves the
previous checkpoint intact and loadable; a folder whose ``trainer_state.json`` is missing or not valid JSON is
incomplete and never loaded.

Under FSDP2 (``train.sharding: fsdp``, see [`mmgrpo.sharding`]) the same files are written: every process takes
part in gathering the sharded weights, optimizer state and algorithm state, and the first one writes them whole.
So a checkpoint resumes at any number of processes, sharded or not, and its ``weights/`` load in the stock
libraries. (``torch.distributed.checkpoint`` was not used: its ``.metadata`` file is a pickle.)

Checkpoints of older versions stored the same state as pickles (``optimizer.pt``, ``lr_scheduler.pt``,
``algorithm.pt``, ``rng_rank{r}.pt``), which can run arbitrary code when loaded: they are refused, with the command
that converts them ([`convert_legacy`], ``mmgrpo convert-checkpoint DIR --trust-pickles``). Their weights are
safetensors already, so ``mmgrpo eval --checkpoint`` (weights only, [`load_weights`]) reads them as they are.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import shutil
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError, safe_open

from . import __version__, sharding, state_io
from .errors import RunError
from .state_io import load_state, save_state

STATE_FILE = "trainer_state.json"
WEIGHTS = "weights"
FORMAT = 2  # trainer_state.json's "format": 2 = pickle-free state files (mmgrpo 0.2); absent = the older pickle layout
OPTIMIZER_FILE, SCHEDULER_FILE = "optimizer.safetensors", "lr_scheduler.safetensors"
ALGORITHM_FILE = "algorithm.safetensors"
PREFIX = "step_"
_NAME = re.compile(rf"{PREFIX}(\d+)")


class CheckpointError(RunError):
    """A checkpoint that cannot be written (a full disk) or read back (a missing or broken file); the message names
    the file and what to do, and the command line prints it on one line."""


def _reason(err: BaseException) -> str:
    """The first line of an I/O error, with the file it names."""
    if isinstance(err, OSError) and err.strerror:
        return err.strerror + (f": {err.filename}" if err.filename else "")
    lines = [line.strip() for line in str(err).splitlines() if line.strip()] or [type(err).__name__]
    text = " ".join(lines[:2])  # e.g. torch's "Error(s) in loading state_dict for ...:" and its first mismatch
    return text if len(text) <= 300 else text[:297] + "..."


def _instead(path: Path) -> str:
    """What to do about broken checkpoint `path`: resume from the newest complete checkpoint before it, if any."""
    earlier = [p for p in complete_checkpoints(path.parent) if p.name < path.name]
    if earlier:
        return f"use the checkpoint before it ({earlier[-1]}) or delete {path}"
    return f"delete {path} (the run has no earlier complete checkpoint)"


def verify(path: Path, state: bool = True) -> None:
    """Checks, without loading any model, that checkpoint `path` holds its weights and (with `state`: a resume)
    its optimizer and schedule state, and that every safetensors file among them has a readable, complete header
    (a truncated or garbled file fails here).

    Raises:
        [`CheckpointError`]: naming the missing or broken file and what to do.
    """
    weights = sorted((path / WEIGHTS).rglob("*.safetensors"))  # a component's folder may hold them (transformer/)
    if not weights:
        raise CheckpointError(f"checkpoint {path} has no weights (no *.safetensors under {WEIGHTS}/): {_instead(path)}.")
    files = weights
    if state:
        for name in (OPTIMIZER_FILE, SCHEDULER_FILE):
            if not (path / name).is_file():
                raise CheckpointError(f"checkpoint {path} has no {name}: {_instead(path)}.")
        files = [*files, *sorted(path.glob("*.safetensors"))]  # optimizer, schedule, RNG states, algorithm...
    for file in files:
        try:
            with safe_open(str(file), framework="pt"):
                pass
        except (OSError, SafetensorError) as err:
            raise CheckpointError(f"{file} is unreadable ({_reason(err)}): {_instead(path)}.") from None


def _read_state(path: Path, name: str):
    """[`~mmgrpo.state_io.load_state`] of file `name` of checkpoint `path`, a broken file reported as such."""
    try:
        return load_state(path / name)
    except (OSError, ValueError, SafetensorError) as err:
        raise CheckpointError(f"{path / name} is unreadable ({_reason(err)}): {_instead(path)}.") from None


def rng_file(rank: int) -> str:
    return f"rng_rank{rank}.safetensors"


def rng_state() -> dict:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


def read_metadata(path: str | Path) -> dict | None:
    """The ``trainer_state.json`` of checkpoint folder `path`, or `None` when it is missing, torn or not a record with
    an integer ``step`` (such a folder is incomplete)."""
    try:
        meta = json.loads((Path(path) / STATE_FILE).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    if not isinstance(meta, dict) or type(meta.get("step")) is not int:
        return None
    return meta


def complete_checkpoints(root: str | Path) -> list[Path]:
    """Complete checkpoints under `root`, oldest first: folders ``step_<digits>`` with valid metadata (temporary
    folders of interrupted saves and folders with torn metadata are ignored)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if _NAME.fullmatch(p.name) and p.is_dir() and read_metadata(p) is not None]
    return sorted(found, key=lambda p: int(p.name[len(PREFIX):]))


def save(
    accelerator, root: str | Path, step: int, policy, optimizer, lr_scheduler, state: dict, keep_last: int,
    algorithm=None, modules: list | None = None, files: dict[str, dict] | None = None,
) -> Path:
    """Writes checkpoint `step` atomically from every process (rank 0 the shared parts and `files`' states, by name),
    then deletes all but the newest `keep_last` complete checkpoints (at least one is always kept: the one just
    written). Sharded state (of the prepared `modules`, the optimizer, the algorithm) is gathered whole for rank 0."""
    root = Path(root)
    final = root / f"{PREFIX}{step:07d}"
    tmp = root / f"{PREFIX}{step:07d}.tmp"
    meta = {"step": step, "format": FORMAT, "mmgrpo_version": __version__, **state}
    if algorithm is not None:
        meta["kl"] = algorithm.kl.state_dict()  # the KL weight's update count (every algorithm has one)
    try:
        _write(accelerator, tmp, policy, optimizer, lr_scheduler, meta, algorithm, modules, files or {})
    except (OSError, SafetensorError) as err:  # a full disk, a quota, a vanished folder: nothing half-written stays
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(
            f"could not write checkpoint {final} ({_reason(err)}); "
            f"its temporary folder was removed and earlier checkpoints are intact: free space under {root} (or lower "
            "checkpoint.keep_last), then run again (checkpoint.resume_from=latest continues from the last complete one)."
        ) from None
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        for old in complete_checkpoints(root)[: -max(1, keep_last)]:
            if old != final:
                shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


def _write(accelerator, tmp: Path, policy, optimizer, lr_scheduler, meta: dict, algorithm, modules, files) -> None:
    """Writes every file of a checkpoint into the temporary folder `tmp` (see [`save`]); `meta` is its
    ``trainer_state.json``, written last."""
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    accelerator.wait_for_everyone()
    save_state(rng_state(), tmp / rng_file(accelerator.process_index))
    main = accelerator.is_main_process
    optimizer_state = sharding.full_tensors(optimizer.state_dict(), keep=main)  # every process: a shard each
    has_state = algorithm is not None and algorithm.traits.has_state
    algorithm_state = algorithm.state_dict() if has_state else None
    with sharding.full_parameters(modules or [], here=main):
        if main:
            policy.save_pretrained(str(tmp / WEIGHTS))
    if main:
        algorithm_files = {ALGORITHM_FILE: sharding.full_tensors(algorithm_state)} if has_state else {}
        for name, state in {OPTIMIZER_FILE: optimizer_state, SCHEDULER_FILE: lr_scheduler.state_dict(),
                            **algorithm_files, **files}.items():  # `files`: the caller's states, by file name
            save_state(state, tmp / name)
        _write_json(tmp / STATE_FILE, meta)


@contextlib.contextmanager
def atomic_folder(final: Path, what: str):
    """Yields a temporary folder beside `final` to write `what` (e.g. ``"the exported model"``) into, and renames it
    to `final` (replacing any folder there) once the block completes. If a write fails (a full disk, a quota), the
    temporary folder is removed, `final` is left as it was, and a [`CheckpointError`] says so."""
    final = Path(final)
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        yield tmp
    except (OSError, SafetensorError) as err:
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(f"could not write {what} to {final} ({_reason(err)}); nothing was left there: free "
                              f"space under {final.parent} and try again.") from None
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)


def _write_json(path: Path, record: dict) -> None:
    """Writes `record` to `path` atomically (temporary file, flushed, renamed)."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(json.dumps(record, indent=2))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def resolve(resume_from: str, root: str | Path) -> Path:
    """``"latest"`` (or ``"auto"``) -> newest complete checkpoint under `root`; otherwise the given folder, checked."""
    if resume_from in ("latest", "auto"):
        found = complete_checkpoints(root)
        if not found:
            raise FileNotFoundError(f"checkpoint.resume_from=latest but {root} holds no complete checkpoint.")
        return found[-1]
    path = Path(resume_from)
    if not (path / STATE_FILE).is_file():
        raise FileNotFoundError(f"checkpoint {path} is not a complete checkpoint (no {STATE_FILE}): name a folder "
                                f"{PREFIX}XXXXXXX written by `mmgrpo train`, or use latest.")
    if read_metadata(path) is None:
        raise ValueError(f"checkpoint {path} is incomplete: its {STATE_FILE} is torn or not a record with an integer "
                         "step (a write was interrupted?); resume from an earlier checkpoint.")
    return path


class LegacyCheckpointError(RuntimeError):
    """A checkpoint in the older layout, whose state files are pickles (see [`convert_legacy`])."""


def legacy_files(path: str | Path) -> list[Path]:
    """The pickle state files of the older layout in checkpoint folder `path` (none in a current checkpoint)."""
    path = Path(path)
    names = ["optimizer.pt", "lr_scheduler.pt", "algorithm.pt"]
    return [path / n for n in names if (path / n).is_file()] + sorted(path.glob("rng_rank*.pt"))


def check_format(path: Path) -> dict:
    """The checkpoint's metadata, after checking that its state files are in the current, pickle-free layout.

    Raises:
        `LegacyCheckpointError`: an older checkpoint (pickles); the message names a file and the conversion command.
    """
    meta = read_metadata(path)
    if meta is None:
        raise ValueError(f"checkpoint {path} is incomplete: {STATE_FILE} is missing or torn.")
    if meta.get("format") == FORMAT:
        return meta
    old = legacy_files(path)
    if not old:
        raise ValueError(f"checkpoint {path} has format {meta.get('format')!r}, which this mmgrpo cannot read "
                         f"(expected {FORMAT}): use the mmgrpo version that wrote it.")
    raise LegacyCheckpointError(
        f"checkpoint {path} stores its training state as pickles ({old[0].name}...), which can run arbitrary code "
        f"when loaded, so mmgrpo no longer reads them. If you trust where it came from, convert it once with "
        f"`mmgrpo convert-checkpoint {path} --trust-pickles`, then resume. (`mmgrpo eval --checkpoint` needs only "
        "its weights and works without conversion.)"
    )


def load(accelerator, path: Path, policy, optimizer, lr_scheduler, algorithm=None, weights: bool = True) -> dict:
    """Restores weights (unless `weights` is false: they were loaded before sharding, see [`load_weights`]),
    optimizer, LR schedule, the algorithm's own state and RNG states; returns the trainer state (step, data
    position). Reads safetensors and JSON only. Every process reads the whole state and keeps its shard when the
    parameters are sharded, whatever the number of processes that wrote it."""
    meta = check_format(path)
    has_state = algorithm is not None and algorithm.traits.has_state
    if has_state and not (path / ALGORITHM_FILE).is_file():
        raise FileNotFoundError(f"{path} has no {ALGORITHM_FILE}: it was written by a run of another algorithm.")
    if weights:
        _load_trainable(policy, path)
    if has_state:
        algorithm.load_state_dict(_read_state(path, ALGORITHM_FILE))
    if algorithm is not None:  # checkpoints before "kl" kept a KL schedule's count in ALGORITHM_FILE, or had none
        earlier = _read_state(path, ALGORITHM_FILE) if "kl" not in meta and (path / ALGORITHM_FILE).is_file() else {}
        algorithm.kl.load_state_dict(meta.get("kl") or {"kl_updates": earlier.get("kl_updates", 0)})
    optimizer.load_state_dict(sharding.optimizer_to_layout(_read_state(path, OPTIMIZER_FILE), optimizer))
    lr_scheduler.load_state_dict(_read_state(path, SCHEDULER_FILE))
    if (path / rng_file(accelerator.process_index)).is_file():
        set_rng_state(_read_state(path, rng_file(accelerator.process_index)))
    return meta


def _load_trainable(policy, path: Path) -> None:
    """``policy.load_trainable`` of checkpoint `path`'s weights, a missing, broken or mismatched file reported as a
    [`CheckpointError`]."""
    try:
        policy.load_trainable(str(path / WEIGHTS))
    except (OSError, ValueError, KeyError, RuntimeError, SafetensorError) as err:  # missing, broken, another shape
        raise CheckpointError(f"the weights of checkpoint {path} could not be loaded into this model "
                              f"({_reason(err)}): check that the config is the run's own, or {_instead(path)}.") from None


def load_weights(path: Path, policy, modules: list | None = None, check: bool = False) -> dict:
    """Loads only the trainable weights of checkpoint `path` (current or older layout: both store weights as
    safetensors) into `policy`; returns its metadata (``step``...). What evaluation needs, nothing more. The policy's
    prepared `modules` must not be sharded yet (load before ``prepare``). `check`: refuse a checkpoint whose training
    state is not in the current format first (see [`check_format`]), before a resume loads anything."""
    meta = check_format(path) if check else read_metadata(path)
    if meta is None:
        raise ValueError(f"checkpoint {path} is incomplete: {STATE_FILE} is missing or torn.")
    sharding.check_unsharded(modules or [], "load_weights")
    _load_trainable(policy, path)
    return meta


def preload(resume_from: str | None, root: str | Path, policy) -> Path | None:
    """The checkpoint that `resume_from` names (see [`resolve`]; `None` when it is unset), after checking its format
    and loading its weights into `policy`, which is not prepared yet: every process loads them whole, before
    sharding splits them, so a checkpoint resumes at any number of processes. [`load`] then restores the rest."""
    if not resume_from or resume_from == "auto" and not complete_checkpoints(root):  # auto: a fresh start
        return None
    path = resolve(resume_from, root)
    load_weights(path, policy, check=True)
    return path


def _numpy_globals() -> list:
    """What a pickled numpy RNG state needs beyond tensors and builtins (under numpy 1 and 2 names)."""
    core = getattr(np, "_core", None) or np.core
    rebuild = core.multiarray._reconstruct
    return [np.ndarray, np.dtype, rebuild, (rebuild, "numpy.core.multiarray._reconstruct"),
            (rebuild, "numpy._core.multiarray._reconstruct"),
            *(t for t in vars(np.dtypes).values() if isinstance(t, type) and issubclass(t, np.dtype))]


def _load_legacy_pickle(file: Path):
    """Loads one state pickle of the older layout with torch's restricted unpickler (``weights_only=True``), which
    builds tensors, containers, numbers and numpy arrays only; anything else is refused, never run."""
    try:
        with torch.serialization.safe_globals(_numpy_globals()):
            return torch.load(file, map_location="cpu", weights_only=True)
    except Exception as err:  # the unpickler's errors are of several types; none is recoverable here
        lines = [line for line in str(err).splitlines() if line.strip()]
        reason = next((line for line in lines if "GLOBAL" in line or "Unsupported" in line), lines[-1] if lines else "")
        raise ValueError(f"{file} holds objects that an mmgrpo checkpoint never contains, so it was not converted "
                         f"and nothing in it was run ({reason.strip()}).") from None


def _same(a, b) -> bool:
    """Whether two states are identical, bit for bit (NaNs included)."""
    (sa, ta), (sb, tb) = state_io.flatten(a), state_io.flatten(b)

    def bits(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(-1).view(torch.uint8) if t.numel() else t

    return sa == sb and ta.keys() == tb.keys() and all(
        ta[k].dtype == tb[k].dtype and ta[k].shape == tb[k].shape and torch.equal(bits(ta[k]), bits(tb[k])) for k in ta
    )


def convert_legacy(path: str | Path) -> list[tuple[str, str]]:
    """Converts a checkpoint of the older layout in place: each pickle state file (``optimizer.pt``...) is loaded with
    torch's restricted unpickler, written as ``.safetensors`` and read back to check that it is identical; then
    ``trainer_state.json`` is marked with the current format (the moment the checkpoint switches layout, atomically)
    and the pickles are deleted. An interrupted conversion leaves a checkpoint in the older layout; run it again.

    Returns:
        `list[tuple[str, str]]`: the ``(old, new)`` file names converted (empty if there was nothing to convert).
    """
    path = Path(path)
    meta = read_metadata(path)
    if meta is None:
        raise ValueError(f"{path} is not a complete checkpoint ({STATE_FILE} missing or torn): nothing to convert.")
    if meta.get("format") == FORMAT:
        return []
    done = []
    for old in legacy_files(path):
        state = _load_legacy_pickle(old)
        new = old.with_suffix(".safetensors")
        save_state(state, new)
        if not _same(state, load_state(new)):
            raise RuntimeError(f"{new} does not read back identical to {old}; the checkpoint was left unconverted.")
        done.append((old.name, new.name))
    if not done:
        raise ValueError(f"{path} has neither the current format nor the older pickle files: nothing to convert.")
    _write_json(path / STATE_FILE, {**meta, "format": FORMAT})
    for old, _ in done:
        (path / old).unlink()
    return done
