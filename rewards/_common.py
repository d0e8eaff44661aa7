"""Helpers shared by the rewards (not a plugin: no ``PLUGIN``): media frames, answer extraction, NaN vectors."""

from __future__ import annotations

import re
from typing import Any

import torch

NAN = float("nan")
MEDIA_KEYS = {"image": "images", "video": "videos"}  # modality -> key in `outputs`


def nans(n: int) -> torch.Tensor:
    """A `[n]` float32 vector of NaN ("not applicable")."""
    return torch.full((n,), NAN, dtype=torch.float32)


def frames(outputs: dict[str, Any], modality: str, reward: str) -> tuple[torch.Tensor, int]:
    """The images to score and the number of frames per sample.

    Args:
        outputs (`dict`): ``"images"`` `[N, 3, H, W]` or ``"videos"`` `[N, F, 3, H, W]`, values in [0, 1].
        modality (`str`): ``"image"`` or ``"video"``.
        reward (`str`): the reward's name, for errors.

    Returns:
        `tuple`: the frames `[N * F, 3, H, W]` (float32, detached, non-finite values set to 0) and `F` (1 for images).

    Raises:
        ValueError: when the key is missing or the tensor has the wrong shape (a wiring error, not a bad sample).
    """
    key = MEDIA_KEYS[modality]
    value = outputs.get(key)
    ndim = 4 if modality == "image" else 5
    if not isinstance(value, torch.Tensor) or value.dim() != ndim or value.shape[-3] != 3:
        shape = "[N, 3, H, W]" if modality == "image" else "[N, F, 3, H, W]"
        got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise ValueError(
            f"{reward}: expected outputs[{key!r}] as a tensor {shape} in [0, 1], got {got}; "
            f"set the reward's `modality` to what the pipeline produces."
        )
    value = value.detach().float()
    per_sample = 1 if modality == "image" else value.shape[1]
    flat = value.reshape(-1, *value.shape[-3:])  # [N * F, 3, H, W]
    return torch.nan_to_num(flat, nan=0.0, posinf=1.0, neginf=0.0), per_sample


def non_finite_samples(outputs: dict[str, Any], modality: str) -> torch.Tensor:
    """`[N]` float 0/1: 1 where a sample's pixels hold NaN or infinity (counted as ``malformed``)."""
    value = outputs[MEDIA_KEYS[modality]].detach()
    return (~torch.isfinite(value)).flatten(1).any(dim=1).float().cpu()


def last_tag_block(text: str, tag: str) -> str | None:
    """Contents of the last ``<tag>...</tag>`` block of `text` (across lines), or None if there is none."""
    blocks = re.findall(rf"<{re.escape(tag)}>(.*?)</{re.escape(tag)}>", text, flags=re.DOTALL)
    return blocks[-1] if blocks else None


def last_boxed(text: str) -> str | None:
    """Contents of the last ``\\boxed{...}`` of `text`, with nested braces, or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, begin = 0, start + len("\\boxed{")
    for position in range(begin, len(text)):
        char = text[position]
        if char == "{":
            depth += 1
        elif char == "}":
            if depth == 0:
                return text[begin:position]
            depth -= 1
    return None


def texts(outputs: dict[str, Any], n: int, reward: str) -> list[str | None]:
    """``outputs["texts"]`` as a list of `n` entries; an entry that is not a string becomes None (malformed)."""
    value = outputs.get("texts")
    if not isinstance(value, (list, tuple)) or len(value) != n:
        got = f"{type(value).__name__} of length {len(value)}" if isinstance(value, (list, tuple)) else type(value).__name__
        raise ValueError(f"{reward}: expected outputs['texts'] as a list of {n} strings, got {got}.")
    return [item if isinstance(item, str) else None for item in value]
