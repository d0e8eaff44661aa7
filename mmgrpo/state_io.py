"""Training state (optimizer, LR schedule, an algorithm's own state, RNG states) stored without pickles.

A nested state (dicts, lists, tuples, numbers, strings, `None`, tensors and numpy arrays) is split by [`flatten`]
into a JSON skeleton, in which each tensor / array is a placeholder, and a flat dict of tensors; [`save_state`]
writes both into one ``.safetensors`` file (the tensors as safetensors, the skeleton as JSON in its header's
metadata), atomically. Neither format can carry code: [`load_state`] parses JSON and raw tensor bytes, nothing else.

The round trip is exact: floats are written with Python's shortest round-tripping repr (non-finite ones as tagged
strings, so the JSON stays standard), tuples stay tuples (``random.setstate`` needs them), dict keys keep their
type (an optimizer's state is keyed by int), numpy arrays and scalars keep their dtype. Tensors come back on the
CPU, without ``requires_grad``. Anything else (a function, a custom object) is refused with its path in the state.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import numpy as np
import torch

FORMAT = "mmgrpo.state/1"
_TAGS = ("__tensor__", "__ndarray__", "__tuple__", "__dict__", "__float__")


def flatten(state) -> tuple[object, dict[str, torch.Tensor]]:
    """Splits `state` into ``(skeleton, tensors)``: a JSON-serialisable skeleton whose tensors and numpy arrays are
    placeholders naming an entry of `tensors` (CPU, contiguous copies)."""
    tensors: dict[str, torch.Tensor] = {}

    def encode(value, where: str):
        if isinstance(value, torch.Tensor):
            name = str(len(tensors))
            tensors[name] = value.detach().to("cpu", copy=True).contiguous()
            return {"__tensor__": name}
        if isinstance(value, (np.ndarray, np.generic)):
            array = np.asarray(value)
            if array.dtype.hasobject:
                raise TypeError(f"{where}: a numpy array of Python objects cannot be stored without pickles.")
            try:
                tensor = torch.from_numpy(np.array(array, order="C", copy=True))
            except TypeError as err:
                raise TypeError(f"{where}: a numpy {array.dtype} array cannot be stored as a tensor ({err}).") from None
            name = str(len(tensors))
            tensors[name] = tensor
            return {"__ndarray__": name, "scalar": isinstance(value, np.generic)}
        if value is None or isinstance(value, (bool, int, str)):
            return value
        if isinstance(value, float):
            return value if math.isfinite(value) else {"__float__": repr(value)}  # 'nan', 'inf', '-inf'
        if isinstance(value, tuple):
            return {"__tuple__": [encode(v, f"{where}[{i}]") for i, v in enumerate(value)]}
        if isinstance(value, list):
            return [encode(v, f"{where}[{i}]") for i, v in enumerate(value)]
        if isinstance(value, dict):
            if all(isinstance(k, str) and k not in _TAGS for k in value):
                return {k: encode(v, f"{where}[{k!r}]") for k, v in value.items()}
            return {"__dict__": [[encode(k, f"{where} key"), encode(v, f"{where}[{k!r}]")] for k, v in value.items()]}
        raise TypeError(
            f"{where}: a {type(value).__name__} cannot be stored without pickles; keep state to dicts, lists, tuples, "
            "numbers, strings, None, tensors and numpy arrays."
        )

    return encode(state, "state"), tensors


def unflatten(skeleton, tensors: dict[str, torch.Tensor]):
    """Inverse of [`flatten`]: rebuilds the state from its skeleton and tensors."""

    def decode(value):
        if isinstance(value, list):
            return [decode(v) for v in value]
        if not isinstance(value, dict):
            return value
        tag = next((key for key in value if key in _TAGS), None)
        if tag == "__tensor__":
            return tensors[value["__tensor__"]]
        if tag == "__ndarray__":
            array = tensors[value["__ndarray__"]].numpy()
            return array[()] if value.get("scalar") else array
        if tag == "__tuple__":
            return tuple(decode(v) for v in value["__tuple__"])
        if tag == "__dict__":
            return {_hashable(decode(k)): decode(v) for k, v in value["__dict__"]}
        if tag == "__float__":
            return float(value["__float__"])
        return {k: decode(v) for k, v in value.items()}

    return decode(skeleton)


def _hashable(key):
    return tuple(_hashable(k) for k in key) if isinstance(key, (list, tuple)) else key


def save_state(state, path: str | Path) -> None:
    """Writes `state` to the ``.safetensors`` file `path` atomically (a temporary file, flushed, then renamed): a
    crash leaves the previous file or none, never a torn one."""
    from safetensors.torch import save_file

    skeleton, tensors = flatten(state)
    metadata = {"format": FORMAT, "state": json.dumps(skeleton, allow_nan=False)}
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, str(tmp), metadata=metadata)
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)


def load_state(path: str | Path):
    """Reads a state written by [`save_state`] (tensors on the CPU).

    Raises:
        `ValueError`: `path` is not such a file (no state in its metadata, or another format).
    """
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        metadata = f.metadata() or {}
        if metadata.get("format") != FORMAT or "state" not in metadata:
            raise ValueError(
                f"{path} holds no mmgrpo state (format {metadata.get('format')!r}, expected {FORMAT!r}): "
                "point at a file written by mmgrpo's checkpoints."
            )
        tensors = {key: f.get_tensor(key) for key in f.keys()}
    return unflatten(json.loads(metadata["state"]), tensors)
