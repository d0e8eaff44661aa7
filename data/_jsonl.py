"""Reading JSONL prompt files, shared by the JSONL prompt sources (`vlm_jsonl`, `referring_jsonl`): rows, media
paths, and the header check of every local image a row names (`mmgrpo.image_files.open_image`: at most
`max_image_pixels` pixels, refused before decoding)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

from mmgrpo.hub import data_path
from mmgrpo.image_files import open_image


def read_items(file: str, image_root: str | None, item: Callable[[dict, Path], dict]) -> list[dict]:
    """The prompt items of one JSONL file, one per non-blank line, built by ``item(row, root)``.

    Args:
        file (`str`): the JSONL file.
        image_root (`str`, *optional*): the folder of relative image / video paths (default: the file's folder).
        item (`Callable`): builds an item from a parsed row and the media root.

    Raises:
        `ValueError`: naming the file and line of a row `item` refuses, or a file without rows.
    """
    path = Path(data_path(file))  # the shipped example rows when `file` names them and is not here
    root = Path(image_root).expanduser() if image_root else path.parent
    items = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if line.strip():
            try:
                items.append(item(json.loads(line), root))
            except (ValueError, KeyError, TypeError, OSError) as err:
                raise ValueError(f"{path}:{number}: {err}") from err
    if not items:
        raise ValueError(f"{path} holds no rows.")
    return items


def resolve_media(location: str, root: Path) -> str:
    """A path relative to `root` made absolute (URIs and absolute paths unchanged); it must exist."""
    if "://" in location or location.startswith("data:"):
        return location
    path = Path(location).expanduser()
    path = path if path.is_absolute() else root / path
    if not path.exists():
        raise ValueError(f"image or video {location!r} not found (looked at {path}); set data.image_root.")
    return str(path)


def image_size(location: str, max_pixels: int) -> tuple[int, int] | None:
    """``(width, height)`` of a local image read from its header, refused (naming the file) beyond `max_pixels`
    pixels before anything is decoded; `None` for a URI (``http://...``, ``data:``), which the pipeline reads."""
    if "://" in location or location.startswith("data:"):
        return None
    with open_image(location, max_pixels) as image:
        return image.size
