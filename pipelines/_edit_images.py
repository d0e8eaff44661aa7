"""The input images of the image-editing adapters (`flux_kontext`, `qwen_image_edit`): read from the prompt batch's
``conditions["images"]`` (what the pipelines declare with the ``"input_images"`` capability), opened, and encoded
once per distinct image (a group shares its prompt's image) into latents the trajectory keeps as conditioning.

An image is a path (opened with [`mmgrpo.image_files.open_image`], its size checked before decoding; the prompt
source has already checked it against its own ``max_image_pixels``), a PIL image, or a tensor `[3, H, W]` in [0, 1].

Not a plugin: its name starts with an underscore, so the registry skips it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch

from mmgrpo.image_files import MAX_IMAGE_PIXELS_LIMIT, open_image
from mmgrpo.types import PromptBatch, as_list

CAPABILITY = "input_images"  # the capability an editing pipeline declares: it reads conditions["images"]


def batch_images(batch: PromptBatch, pipeline: str, most: int | None = None) -> list[list[Any]]:
    """Each sample's input images (a list per sample, at least one, at most `most`), as the batch holds them.

    Raises:
        `ValueError`: a batch without ``conditions["images"]``, or a sample with no image or too many, in one line.
    """
    images = batch.conditions.get("images")
    if images is None or len(images) != len(batch):
        raise ValueError(
            f"{pipeline} edits images: each prompt needs its input image(s) in the prompt batch's conditions['images'] "
            f"(paths, PIL images or [3, H, W] tensors in [0, 1]); this batch has none. Use a data source with images "
            f"(data: edit_jsonl or shapes_edit)."
        )
    rows = [as_list(item) for item in images]
    for i, row in enumerate(rows):
        if not row or (most is not None and len(row) > most):
            raise ValueError(f"{pipeline}: prompt {i} ({batch.prompts[i]!r}) has {len(row)} input images; it takes 1 "
                             f"to {most or 'several'}.")
    return rows


def to_pixels(image: Any) -> Any:
    """A PIL RGB image, or the tensor `[1, 3, H, W]` in [0, 1] of a `[3, H, W]` one; paths are opened size-checked."""
    if isinstance(image, (str, Path)):
        with open_image(image, MAX_IMAGE_PIXELS_LIMIT) as opened:
            return opened.convert("RGB")
    if isinstance(image, torch.Tensor):
        return image[None].float() if image.dim() == 3 else image.float()
    return image.convert("RGB")


def to_pil(image: Any):
    """A PIL RGB image of what [`to_pixels`] returns (a tensor `[1, 3, H, W]` in [0, 1] quantised to 8 bits)."""
    if not isinstance(image, torch.Tensor):
        return image
    from PIL import Image

    return Image.fromarray((image[0].clamp(0, 1) * 255).round().byte().permute(1, 2, 0).cpu().numpy())


def image_key(image: Any) -> Any:
    """What identifies an image for the once-per-image encoding: its path, or the object itself."""
    return str(image) if isinstance(image, (str, Path)) else id(image)


def encode_once(rows: list[list[Any]], encode: Callable[[list[Any]], torch.Tensor]) -> torch.Tensor:
    """``encode(images) -> [1, ...]`` run once per distinct row of images (the samples of a group share theirs);
    returns the rows' encodings stacked, `[N, ...]`."""
    cache: dict[tuple, torch.Tensor] = {}
    out = []
    for row in rows:
        key = tuple(image_key(image) for image in row)
        if key not in cache:
            cache[key] = encode([to_pixels(image) for image in row])
        out.append(cache[key])
    return torch.cat(out)
