"""Opening image files a run reads (prompt sources' images, masks) with a bound on their decoded size.

A few hundred KiB of PNG can hold an 8192 x 8192 image (192 MiB as 8-bit RGB, four times that as floats).
[`open_image`] opens a file lazily, as PIL does (it reads the header: size and mode), and refuses it in one line,
naming the file, its size and the option to raise, before any pixel is decoded when width x height exceeds the limit.
"""

from __future__ import annotations

from pathlib import Path
from typing import IO, TYPE_CHECKING

if TYPE_CHECKING:  # PIL is imported when an image is opened
    from PIL import Image

DEFAULT_MAX_IMAGE_PIXELS = 1 << 26  # 8192 x 8192: larger than the images of common VQA / grounding / segmentation sets
MAX_IMAGE_PIXELS_LIMIT = 1 << 27  # the highest a source accepts (PIL itself refuses more than ~179 million pixels)


def open_image(source: str | Path | IO[bytes], max_pixels: int, name: str | None = None,
               option: str = "data.max_image_pixels") -> Image.Image:
    """`source` opened lazily (nothing decoded yet), after checking its header's size against `max_pixels`.

    Args:
        source (`str`, `Path` or a binary file object): the image.
        max_pixels (`int`): the most width x height accepted.
        name (`str`, *optional*): how errors name the image (default: `source`).
        option (`str`, defaults to `"data.max_image_pixels"`): the option errors tell the user to raise.

    Returns:
        `PIL.Image.Image`: the open image (use it in a ``with`` block; ``.load()`` or ``.convert()`` decodes it).

    Raises:
        `ValueError`: the image claims more than `max_pixels` pixels, in one line. PIL's own errors (`OSError` for a
        file that is not an image) pass through.
    """
    from PIL import Image

    name = name or str(source)
    try:
        image = Image.open(source)
    except Image.DecompressionBombError as err:  # PIL's own, higher bound, also checked from the header
        raise ValueError(f"image {name} is too large to decode ({err}); a source reads at most {max_pixels} pixels "
                         f"per image ({option})") from None
    width, height = image.size
    if width * height > max_pixels:
        image.close()
        raise ValueError(f"image {name} is {width}x{height} ({width * height} pixels), over the limit of "
                         f"{max_pixels} pixels per image: raise {option} (at most {MAX_IMAGE_PIXELS_LIMIT}) to read "
                         f"it, or shrink it")
    return image
