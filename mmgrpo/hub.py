"""Resolving model locations: a local folder, a Hugging Face hub id, or a model shipped with mmgrpo."""

from __future__ import annotations

import os
from pathlib import Path

import torch

SHIPPED_PREFIX = "mmgrpo:"
# `weights_dtype` names a config may use -> torch dtypes (one table for every pipeline)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def shipped_weights_dir() -> Path:
    """The folder of the toy base models shipped inside the package (``mmgrpo/data/weights``; in an editable
    install ``mmgrpo.data`` maps to the repository's ``data/``)."""
    import mmgrpo.data

    return Path(mmgrpo.data.__file__).resolve().parent / "weights"


def shipped_configs_dir() -> Path:
    """The folder of the experiment configs shipped inside the package (``mmgrpo/configs``; in an editable install
    ``mmgrpo.configs`` maps to the repository's ``configs/``)."""
    import mmgrpo.configs

    return Path(mmgrpo.configs.__file__).resolve().parent


def is_hub_id(location: str) -> bool:
    """Whether `location` is a well-formed hub repository id ``namespace/name`` by the hub client's own rules
    (``huggingface_hub.utils.validate_repo_id``: its characters, no ``--`` or ``..``, no ``.git`` ending, at most 96
    characters), and not a shipped model (``mmgrpo:<name>``) or an existing local path."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    if location.count("/") != 1 or location.startswith(SHIPPED_PREFIX) or os.path.exists(os.path.expanduser(location)):
        return False
    try:
        validate_repo_id(location)
    except HFValidationError:
        return False
    return True


EXAMPLES = "data/examples/"  # the example data the shipped real-model configs name (``mmgrpo/data/examples`` installed)


def data_path(location: str) -> str:
    """A data file or folder a config names, ``~`` expanded: `location` itself when it exists, else, for a relative
    path under ``data/examples/`` (the example rows the shipped real-model configs read), the copy shipped inside the
    package, so those configs run from any folder and from an installed wheel."""
    expanded = os.path.expanduser(location)
    if os.path.exists(expanded) or not location.replace(os.sep, "/").startswith(EXAMPLES):
        return expanded
    shipped = shipped_weights_dir().parent / location[len("data/"):]
    return str(shipped) if shipped.exists() else expanded


def resolve_config(location: str) -> str:
    """An experiment config's path: `location` itself when it is a file, else the shipped config of that name
    (``t2i_shapes`` -> ``tiny/t2i_shapes.yaml``, ``sd3_5_medium_flow_grpo``, ``tiny/vlm_count.yaml``...).

    Raises:
        `FileNotFoundError`: neither; the message lists the shipped configs.
    """
    if Path(location).expanduser().is_file():
        return location
    root = shipped_configs_dir()
    stem = location.removesuffix(".yaml")
    for candidate in (root / f"{stem}.yaml", root / "tiny" / f"{stem}.yaml"):
        if candidate.is_file():
            return str(candidate)
    names = sorted(p.relative_to(root).with_suffix("").as_posix().removeprefix("tiny/")
                   for p in root.rglob("*.yaml") if p.parent.name != "accelerate")
    raise FileNotFoundError(f"config {location!r} is neither a file nor a shipped config; shipped: {', '.join(names)}")


_LOCAL_FOLDERS = {
    "model": "a local diffusers/transformers folder (one written by save_pretrained)",
    "dataset": "a local dataset folder (one written by save_to_disk, or a folder of data files)",
}


PICKLE_WEIGHTS = ("*.bin", "*.pt", "*.pth", "*.ckpt", "*.pkl")  # weight files that are pickles
NOT_WEIGHTS = {"training_args.bin"}  # a trainer's pickle that from_pretrained never reads


def refuse_pickle_weights(folder: Path, key: str) -> None:
    """Refuses a local model folder (or a component folder one level below it, as in a diffusers pipeline) whose
    weights are pickles only (``pytorch_model.bin``, ``*.pt``...): loading a pickle can run code, so mmgrpo loads
    safetensors weights only (``use_safetensors=True``). Raises `ValueError` naming the file and the conversion."""
    for where in [folder, *sorted(p for p in folder.iterdir() if p.is_dir())]:
        pickles = sorted(f for pattern in PICKLE_WEIGHTS for f in where.glob(pattern) if f.name not in NOT_WEIGHTS)
        if pickles and not any(where.glob("*.safetensors")):
            raise ValueError(
                f"{key}: {pickles[0]} is a pickle weights file and {where} has no *.safetensors weights; mmgrpo loads "
                "safetensors only (a pickle can run code when loaded). Convert the model once where you trust it "
                "(load it with transformers / diffusers and save_pretrained(folder, safe_serialization=True)) and "
                f"point {key} at the converted folder."
            )


def resolve_pretrained(location: str, key: str = "pretrained", what: str = "model") -> str:
    """Turns a config's model (or dataset) location into what ``from_pretrained`` accepts, or raises a clear error.

    Args:
        location (`str`): ``mmgrpo:<name>`` for a shipped toy model, a local folder, or a hub id (``org/name``).
        key (`str`): the config key, named in errors.
        what (`str`): ``"model"`` or ``"dataset"``: what the location holds, named in errors.
    """
    if location.startswith(SHIPPED_PREFIX):
        name = location[len(SHIPPED_PREFIX):]
        path = shipped_weights_dir() / name
        if not path.is_dir():
            available = sorted(p.name for p in shipped_weights_dir().glob("*") if p.is_dir())
            raise ValueError(f"{key}: no shipped model {name!r}; shipped models: {available}.")
        return str(path)
    expanded = os.path.expanduser(location)
    if os.path.isdir(expanded):
        if what == "model":
            refuse_pickle_weights(Path(expanded), key)
        return expanded
    if os.path.isfile(expanded):
        raise ValueError(
            f"{key}: {location!r} is a file; point {key} at the folder holding the model ({_LOCAL_FOLDERS[what]})"
            + (", whose weights are safetensors" if what == "model" else "") + "."
        )
    looks_local = location.startswith(("/", ".", "~")) or os.sep in location.strip("/").replace("/", "", 1)
    if looks_local or not is_hub_id(location):
        raise ValueError(
            f"{key}: {what} folder {location!r} does not exist. Point {key} at {_LOCAL_FOLDERS[what]}, a hub id "
            f"like 'org/{what}'" + (f", or a shipped model '{SHIPPED_PREFIX}<name>'." if what == "model" else ".")
        )
    return location


def load_diffusers_pipeline(pipeline_cls, location: str, **kwargs):
    """``pipeline_cls.from_pretrained(location)`` that also accepts a local folder saved with missing (None)
    components, such as an SD3 pipeline without its T5 encoder: ``model_index.json`` lists them as null and
    diffusers refuses to load them unless they are passed explicitly as None."""
    import json

    location = resolve_pretrained(location, "pipeline.pretrained")  # a configured mmgrpo:<name> is a shipped folder
    index_file = Path(location) / "model_index.json"
    if index_file.is_file():
        index = json.loads(index_file.read_text(encoding="utf-8"))
        for name, value in index.items():
            if isinstance(value, list) and value and value[0] is None:
                kwargs.setdefault(name, None)
    return pipeline_cls.from_pretrained(location, use_safetensors=True, **kwargs)  # never a pickle
