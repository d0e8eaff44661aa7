"""Image-editing prompts from JSONL: one row per edit, an instruction and its input image(s).

A row is ``{"image": "in.png" | ["a.png", "b.png"], "instruction": "make the sky red", "target_image": "out.png",
"edit_mask": "mask.png", ...}``: ``image`` (or ``images``) and ``instruction`` (or ``prompt``) are required;
``target_image`` (the expected result) and ``edit_mask`` (non-zero where the edit applies) are optional, for rewards that
compare with them (`edit_fidelity`). Relative paths are read from `image_root` (default: the JSONL file's folder). Each
row becomes a prompt item: the instruction as the prompt, the input images (paths) as ``conditions["images"]``, which
the editing pipelines read (``flux_kontext``), and metadata with ``source_image`` (the first input image),
``target_image`` and ``edit_mask`` as absolute paths, plus every other key of the row.

Every image a row names is checked from its header when the file is read: one over `max_image_pixels` pixels is
refused, naming the file, its size and the option, before anything is decoded; a missing key or file is refused in one
line naming the file and row.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from mmgrpo.data._jsonl import image_size, read_items, resolve_media
from mmgrpo.hub import data_path
from mmgrpo.image_files import DEFAULT_MAX_IMAGE_PIXELS, MAX_IMAGE_PIXELS_LIMIT
from mmgrpo.types import as_list
from mmgrpo.validation import check_fields, check_range

IMAGE_KEYS = ("image", "images")
INSTRUCTION_KEYS = ("instruction", "prompt")
TRUTH_KEYS = ("target_image", "edit_mask")


@dataclass
class EditJsonlConfig:
    """Options of [`EditJsonl`].

    Args:
        train_file (`str`): the training JSONL.
        eval_file (`str`, *optional*): held-out rows in the same format.
        image_root (`str`, *optional*): folder of relative image paths (default: each file's folder).
        max_image_pixels (`int`, defaults to 67108864): the most pixels (width x height) of one image, read from its
            header; a larger one is refused before decoding. At most 134217728.
    """

    train_file: str
    eval_file: str | None = None
    image_root: str | None = None
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS

    def __post_init__(self):
        check_fields(self)
        check_range("max_image_pixels", self.max_image_pixels, 1, MAX_IMAGE_PIXELS_LIMIT,
                    fix="the default 67108864 is 8192 x 8192")
        if self.image_root is not None and not Path(self.image_root).expanduser().is_dir():
            raise ValueError(f"data.image_root: {self.image_root!r} is not a folder; give the folder of the images.")
        for key, value in {"train_file": self.train_file, "eval_file": self.eval_file}.items():
            if value is not None and not Path(data_path(value)).is_file():
                raise ValueError(f"data.{key}: {value!r} does not exist; give a JSONL file (see data/edit_jsonl.py).")


def _first(row: dict, keys: tuple[str, ...], what: str):
    for key in keys:
        if row.get(key) not in (None, "", []):
            return row[key]
    raise KeyError(f"the row has no {what}: add {' or '.join(repr(k) for k in keys)}")


class EditJsonl:
    """Edit prompt items (instruction, input images, optional target image and mask) from JSONL files."""

    Config = EditJsonlConfig
    disjoint_splits = False  # the user's files decide

    def __init__(self, config: EditJsonlConfig):
        self.config = config

    def train_items(self) -> list[dict]:
        return self.read(self.config.train_file)

    def eval_items(self) -> list[dict]:
        return self.read(self.config.eval_file) if self.config.eval_file else []

    def eval_splits(self) -> dict[str, list[dict]]:
        return {"eval": self.eval_items()}  # one held-out split

    def read(self, file: str) -> list[dict]:
        """The prompt items of one JSONL file; errors name the file and line."""
        return read_items(file, self.config.image_root, self.item)

    def item(self, row: dict, root: Path) -> dict:
        if not isinstance(row, dict):
            raise TypeError(f"a row must be a JSON object with 'image' and 'instruction', got {type(row).__name__}")
        instruction = _first(row, INSTRUCTION_KEYS, "instruction")
        if not isinstance(instruction, str) or not instruction.strip():
            raise ValueError(f"the instruction must be a non-empty string, got {instruction!r}")
        images = [resolve_media(str(p), root) for p in as_list(_first(row, IMAGE_KEYS, "input image"))]
        metadata = {k: v for k, v in row.items() if k not in (*IMAGE_KEYS, *INSTRUCTION_KEYS, *TRUTH_KEYS)}
        metadata["source_image"] = images[0]
        for key in TRUTH_KEYS:
            if row.get(key) is not None:
                metadata[key] = resolve_media(str(row[key]), root)
        for path in [*images, *(metadata.get(k) for k in TRUTH_KEYS)]:
            if path is not None:
                image_size(path, self.config.max_image_pixels)  # headers only; refused beyond the limit
        return {"prompt": instruction, "metadata": metadata, "images": images}


PLUGIN = EditJsonl
