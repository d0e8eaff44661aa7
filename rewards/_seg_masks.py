"""Ground-truth masks as referring-segmentation sets carry them, and the segmentation metrics gIoU / cIoU (not a plugin:
no ``PLUGIN``; shared by `sam_mask`, `s_measure` and the `referring_jsonl` prompt source).

Mask encodings ([`load_mask`]):

- a tensor, numpy array or nested lists `[H, W]`: non-zero is foreground (a 0/255 PNG works);
- a PNG (or any image PIL reads) path: non-zero in any channel is foreground;
- COCO RLE ``{"size": [H, W], "counts": [...] | "<compressed>"}``: run lengths over the pixels in column-major order
  (down each column, then the next column), starting with a run of background (maybe of length 0); ``counts`` as a
  list of integers or in COCO's compressed text form (5 bits per character, offset 48, bit 0x20 "more", bit 0x10 the
  sign of the last chunk, every count after the second stored as the difference to the count two before it);
- polygons ``{"polygons": [[x1, y1, x2, y2, ...], ...], "size": [H, W]}`` (COCO's ``segmentation`` list), in pixels with
  pixel ``(col, row)`` covering ``[col, col + 1) x [row, row + 1)``: a pixel is foreground when its centre
  ``(col + 0.5, row + 0.5)`` is inside a polygon (even-odd rule; the polygons of one object are united). pycocotools
  rasterises edges on a 5x finer grid, so masks may differ from it along the boundary by at most one pixel.

Metrics over a set of images (Seg-Zero, LISA): gIoU is the mean of per-image IoUs (an image whose truth and prediction
are both empty counts 1); cIoU is the summed intersection over the summed union (pixels), which weighs large objects
more. The `sam_mask` reward reports per sample ``iou``, ``intersection`` and ``union``, so over an evaluation
``mean(iou)`` is the gIoU and ``mean(intersection) / mean(union)`` the cIoU ([`giou_ciou`]).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from mmgrpo.image_files import DEFAULT_MAX_IMAGE_PIXELS, open_image


def rle_counts_from_string(text: str) -> list[int]:
    """COCO's compressed RLE text -> run lengths (the inverse of [`rle_counts_to_string`])."""
    counts: list[int] = []
    position = 0
    while position < len(text):
        value, shift, more = 0, 0, True
        while more:
            if position >= len(text):
                raise ValueError("RLE counts string ends inside a number")
            chunk = ord(text[position]) - 48
            if not 0 <= chunk < 64:
                raise ValueError(f"RLE counts string has a character {text[position]!r} outside '0'..'o'")
            value |= (chunk & 0x1F) << (5 * shift)
            more = bool(chunk & 0x20)
            position, shift = position + 1, shift + 1
            if not more and chunk & 0x10:
                value |= -1 << (5 * shift)  # sign-extend the last chunk
        if len(counts) > 2:
            value += counts[-2]
        counts.append(value)
    return counts


def rle_counts_to_string(counts: list[int]) -> str:
    """Run lengths -> COCO's compressed RLE text (as pycocotools writes it)."""
    out = []
    for i, count in enumerate(counts):
        value = count - counts[i - 2] if i > 2 else count
        more = True
        while more:
            chunk = value & 0x1F
            value >>= 5
            more = value != -1 if chunk & 0x10 else value != 0
            out.append(chr(48 + (chunk | (0x20 if more else 0))))
    return "".join(out)


def rle_decode(rle: dict) -> torch.Tensor:
    """COCO RLE ``{"size": [H, W], "counts": ...}`` -> a bool mask `[H, W]`."""
    height, width = (int(v) for v in rle["size"])
    counts = rle["counts"]
    counts = rle_counts_from_string(counts) if isinstance(counts, str) else [int(c) for c in counts]
    if any(c < 0 for c in counts) or sum(counts) != height * width:
        raise ValueError(f"RLE counts sum to {sum(counts)} (or hold a negative run); a {height}x{width} mask needs "
                         f"{height * width}")
    values = np.repeat(np.arange(len(counts)) % 2 == 1, counts)  # [H * W], column-major
    return torch.from_numpy(values.reshape(width, height).T.copy())  # [H, W]


def rle_encode(mask: torch.Tensor) -> dict:
    """A bool mask `[H, W]` -> COCO RLE with integer counts (the inverse of [`rle_decode`])."""
    flat = mask.bool().T.reshape(-1).numpy()  # column-major
    changes = np.flatnonzero(flat[1:] != flat[:-1]) + 1
    bounds = np.concatenate([[0], changes, [flat.size]])
    counts = np.diff(bounds).tolist()
    if flat.size and flat[0]:
        counts = [0] + counts
    return {"size": [int(mask.shape[0]), int(mask.shape[1])], "counts": [int(c) for c in counts]}


def polygons_to_mask(polygons: list, height: int, width: int) -> torch.Tensor:
    """Rasterises polygons (each a flat list ``[x1, y1, x2, y2, ...]``, at least 3 vertices) into a bool mask
    `[height, width]`: pixel centres inside any polygon (even-odd rule), see the module docstring."""
    mask = torch.zeros(height, width, dtype=torch.bool)
    centres = torch.arange(height, dtype=torch.float64) + 0.5  # [H] row centres
    for polygon in polygons:
        xy = torch.as_tensor(polygon, dtype=torch.float64)
        if xy.dim() != 1 or xy.numel() < 6 or xy.numel() % 2 or not torch.isfinite(xy).all():
            raise ValueError(f"a polygon must be a flat list of at least 3 finite (x, y) pairs, got {polygon!r}")
        start = xy.view(-1, 2)  # [E, 2]
        end = start.roll(-1, dims=0)  # [E, 2]
        low, high = torch.minimum(start[:, 1], end[:, 1]), torch.maximum(start[:, 1], end[:, 1])  # [E]
        crosses = (centres[:, None] >= low) & (centres[:, None] < high)  # [H, E]
        slope = (end[:, 0] - start[:, 0]) / torch.where(high > low, end[:, 1] - start[:, 1], torch.ones_like(low))
        x_cross = start[:, 0] + (centres[:, None] - start[:, 1]) * slope  # [H, E]
        # a pixel centre col + 0.5 lies left of the crossing when col < ceil(x - 0.5): count the crossings to its right
        first_right = (x_cross - 0.5).ceil().clamp(0, width).long()  # [H, E]
        marks = torch.zeros(height, width + 1, dtype=torch.long)
        marks.scatter_add_(1, first_right, crosses.long())
        right = crosses.sum(dim=1, keepdim=True) - marks.cumsum(dim=1)[:, :width]  # [H, W] crossings right of centre
        mask |= right % 2 == 1
    return mask


def load_mask(value: Any, size: tuple[int, int] | None = None, root: str | Path | None = None,
              max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS) -> torch.Tensor:
    """A ground-truth mask in any encoding of the module docstring -> a bool tensor `[H, W]`.

    Args:
        value: the encoded mask.
        size (`tuple[int, int]`, *optional*): ``(height, width)`` of the image, for polygons without a ``"size"``.
        root (`str`, *optional*): folder of relative PNG paths.
        max_pixels (`int`, defaults to 67108864): the most pixels of a mask image, read from its header before it is
            decoded (the prompt source's ``max_image_pixels``).

    Raises:
        ValueError: an encoding it cannot read, naming the accepted ones, or a mask image over `max_pixels`.
    """
    if isinstance(value, str):
        path = Path(value).expanduser()
        path = path if path.is_absolute() or root is None else Path(root) / path
        if not path.is_file():
            raise ValueError(f"mask image {value!r} not found (looked at {path})")
        with open_image(path, max_pixels) as image:
            pixels = np.asarray(image)
        return torch.from_numpy(pixels.reshape(*pixels.shape[:2], -1).any(axis=-1))
    if isinstance(value, dict) and "counts" in value:
        return rle_decode(value)
    if isinstance(value, dict) and "polygons" in value:
        shape = value.get("size", size)
        if shape is None:
            raise ValueError("polygons need the image size: give {'polygons': [...], 'size': [H, W]}")
        return polygons_to_mask(value["polygons"], int(shape[0]), int(shape[1]))
    try:
        mask = torch.as_tensor(np.asarray(value))
    except (TypeError, ValueError) as err:
        raise ValueError(f"cannot read a mask from {type(value).__name__}: give a PNG path, COCO RLE "
                         "{'size', 'counts'}, polygons or an [H, W] array") from err
    if mask.dim() != 2:
        raise ValueError(f"a mask array must be [H, W], got shape {tuple(mask.shape)}")
    return mask != 0


def predicted_mask(value: Any, size: tuple[int, int]) -> torch.Tensor | None:
    """A policy's predicted mask as a float mask `[H, W]` in [0, 1] at `size` ``(height, width)`` (resized with
    nearest-neighbour interpolation), or None when it is malformed: missing, not a numeric 2-D array (a string, a list
    of strings, a mapping...), empty or not finite. Rewards score a malformed mask 0 and count it."""
    if value is None or isinstance(value, (str, bytes, dict)):
        return None
    try:
        mask = torch.as_tensor(value).detach().cpu()
    except (TypeError, ValueError, RuntimeError, OverflowError):  # strings, ragged or nested non-numbers
        return None
    if mask.dtype not in (torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64) and \
            not mask.is_floating_point():
        return None  # complex numbers, quantised types
    if mask.dim() != 2 or mask.numel() == 0 or not torch.isfinite(mask.float()).all():
        return None
    mask = mask.float().clamp(0, 1)  # [h, w]
    if tuple(mask.shape) != tuple(size):
        mask = torch.nn.functional.interpolate(mask[None, None], size=tuple(size), mode="nearest")[0, 0]  # [H, W]
    return mask


def intersection_union(pred: torch.Tensor, truth: torch.Tensor) -> tuple[float, float]:
    """Pixel counts of the intersection and the union of two bool masks `[H, W]`."""
    return float((pred & truth).sum()), float((pred | truth).sum())


def giou_ciou(intersections, unions) -> tuple[float, float]:
    """gIoU (mean per-image IoU, 1 for an empty union) and cIoU (summed intersection / summed union; 1 when every union
    is empty) of per-image pixel counts (`[n]` each)."""
    inter = torch.as_tensor(intersections, dtype=torch.float64)
    union = torch.as_tensor(unions, dtype=torch.float64)
    if inter.numel() == 0:
        raise ValueError("giou_ciou needs at least one image")
    per_image = torch.where(union > 0, inter / union.clamp_min(1), torch.ones_like(union))
    total = float(union.sum())
    return float(per_image.mean()), float(inter.sum()) / total if total > 0 else 1.0
