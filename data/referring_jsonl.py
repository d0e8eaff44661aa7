"""Referring-segmentation prompts from JSONL: an image, a referring expression, the object's mask and box per row.

The rows carry what refCOCO(g)-style sets hold (Seg-Zero, Seg-R1, LISA / ReasonSeg converted to rows).

A row::

    {"image": "a.jpg", "problem": "the cat on the left", "mask": "a_mask.png", "bbox": [x1, y1, x2, y2]}

- the expression under `question_key` (``"problem"``; ``"question"``, ``"expression"``, ``"sentence"`` are read too);
- the mask under `mask_key` (``"mask"``): a PNG path (non-zero is the object), COCO RLE ``{"size": [H, W], "counts":
  [...] | "<compressed>"}`` or ``{"polygons": [[x1, y1, x2, y2, ...], ...]}``; or COCO's ``"segmentation"`` (a polygon
  list or RLE), decoded by `mmgrpo.rewards._seg_masks.load_mask` (polygons cover the pixels whose centres are inside);
- the box under ``"bbox"`` or ``"boxes"`` (`box_format` ``"xyxy"``, or COCO's ``"xywh"``), original pixels; without
  one, the mask's tight box ``[min col, min row, max col + 1, max row + 1]``;
- optional ``"points"`` (``[[x, y], ...]``, read by `seg_zero`), any other key (kept in the metadata).

Each row becomes an item: the prompt (`prompt_template`: ``"seg_zero"``, ``"seg_r1"`` or a custom template with
``{question}``), ``images`` ``[path]`` (relative paths from `image_root`, default the JSONL file's folder), and metadata
``mask`` (bool tensor `[H, W]`, decoded once here), ``boxes`` (``[x1, y1, x2, y2]``), ``image_size`` (``[W, H]``, so
`sam_mask` / `seg_zero` map the model's resized frame back, see `rewards/box_iou.py`) and ``question``. A mask of
another size than its image is refused, naming the file and line, and so is an image or mask PNG of more than
`max_image_pixels` pixels, from its header, before it is decoded.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from mmgrpo.data._jsonl import image_size, read_items, resolve_media
from mmgrpo.hub import data_path
from mmgrpo.image_files import DEFAULT_MAX_IMAGE_PIXELS, MAX_IMAGE_PIXELS_LIMIT
from mmgrpo.rewards._seg_masks import load_mask
from mmgrpo.validation import check_fields, check_range, check_template, check_text

TEMPLATES = {
    "seg_zero": (
        'Find "{question}" in the image. Reason about the candidates inside <think> </think>, then answer inside '
        '<answer> </answer> with one JSON object: the object\'s box and two points well inside it, as {{"bbox": '
        '[x1, y1, x2, y2], "points_1": [x, y], "points_2": [x, y]}}.'
    ),
    "seg_r1": (
        'Segment "{question}". Reason inside <think> </think>, then give each part of the object as '
        "<bbox>[x1,y1,x2,y2]</bbox>, points on the image as <points>[[x,y],...]</points> and their labels as "
        "<labels>[1,0,...]</labels> (1 on the object, 0 off it)."
    ),
}
QUESTION_KEYS = ("question", "expression", "sentence")


@dataclass
class ReferringJsonlConfig:
    """Options of [`ReferringJsonl`].

    Args:
        train_file (`str`): the training JSONL.
        eval_file (`str`, *optional*): held-out rows in the same format.
        image_root (`str`, *optional*): folder of relative image and mask paths (default: each file's folder).
        question_key (`str`, defaults to `"problem"`): the expression's key.
        prompt_template (`str`, defaults to `"seg_zero"`): ``"seg_zero"``, ``"seg_r1"`` or a template with
            ``{question}``.
        mask_key (`str`, defaults to `"mask"`): the mask's key (COCO's ``"segmentation"`` is read when it is absent).
        box_format (`str`, defaults to `"xyxy"`): ``"xyxy"`` or COCO's ``"xywh"``.
        max_image_pixels (`int`, defaults to 67108864): the most pixels (width x height) of an image or mask PNG,
            read from its header; a larger one is refused before decoding. At most 134217728.
    """

    train_file: str
    eval_file: str | None = None
    image_root: str | None = None
    question_key: str = "problem"
    prompt_template: str = "seg_zero"
    mask_key: str = "mask"
    box_format: Literal["xyxy", "xywh"] = "xyxy"
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS

    def __post_init__(self):
        check_fields(self)
        check_range("max_image_pixels", self.max_image_pixels, 1, MAX_IMAGE_PIXELS_LIMIT,
                    fix="the default 67108864 is 8192 x 8192")
        check_text("question_key", self.question_key)
        check_text("mask_key", self.mask_key)
        template = TEMPLATES.get(self.prompt_template, self.prompt_template)
        if "{question}" not in template:
            raise ValueError(f"data.prompt_template must be 'seg_zero', 'seg_r1' or contain '{{question}}', got "
                             f"{self.prompt_template!r}.")
        check_template("prompt_template", template, question="q")
        if self.image_root is not None and not Path(self.image_root).expanduser().is_dir():
            raise ValueError(f"data.image_root: {self.image_root!r} is not a folder; give the folder of the images.")
        for key, value in {"train_file": self.train_file, "eval_file": self.eval_file}.items():
            if value is not None and not Path(data_path(value)).is_file():
                raise ValueError(f"data.{key}: {value!r} does not exist; give a JSONL file (see "
                                 "data/referring_jsonl.py).")


def tight_box(mask: torch.Tensor) -> list[float]:
    """``[x1, y1, x2, y2]`` of the pixels of a bool mask `[H, W]` (pixel ``(c, r)`` covers ``[c, c + 1)``)."""
    rows, cols = torch.nonzero(mask, as_tuple=True)
    if rows.numel() == 0:
        raise ValueError("the mask is empty and the row has no box: give 'bbox'")
    return [float(cols.min()), float(rows.min()), float(cols.max()) + 1, float(rows.max()) + 1]


class ReferringJsonl:
    """Referring-segmentation prompt items (image, expression, mask, box) from JSONL files."""

    Config = ReferringJsonlConfig
    disjoint_splits = False  # the user's files decide

    def __init__(self, config: ReferringJsonlConfig):
        self.config = config
        self.template = TEMPLATES.get(config.prompt_template, config.prompt_template)

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
        """One prompt item of a row (see the module docstring)."""
        c = self.config
        question = next((row[k] for k in (c.question_key, *QUESTION_KEYS) if k in row), None)
        if not isinstance(question, str):
            raise KeyError(f"the row has no {c.question_key!r} (or {', '.join(QUESTION_KEYS)}) text")
        image = resolve_media(row["image"], root)
        size = image_size(image, c.max_image_pixels)  # from the header, refused beyond the limit
        if size is None:
            raise ValueError(f"the image must be a local file (its size and mask are read here), got {image!r}")
        width, height = size
        encoded = row.get(c.mask_key, row.get("segmentation"))
        if encoded is None:
            raise KeyError(f"the row has no {c.mask_key!r} (or 'segmentation') mask")
        if isinstance(encoded, list):  # COCO's segmentation list: polygons
            encoded = {"polygons": encoded}
        mask = load_mask(encoded, size=(height, width), root=root, max_pixels=c.max_image_pixels)  # [H, W]
        if tuple(mask.shape) != (height, width):
            raise ValueError(f"the mask is {mask.shape[1]}x{mask.shape[0]} but the image {image} is {width}x{height}")
        box = row.get("bbox", row.get("boxes"))
        if box is None:
            box = tight_box(mask)
        box = [float(v) for v in torch.tensor(box, dtype=torch.float64).reshape(-1, 4)[0].tolist()]
        if c.box_format == "xywh":
            box = [box[0], box[1], box[0] + box[2], box[1] + box[3]]
        skip = {c.question_key, *QUESTION_KEYS, "image", c.mask_key, "segmentation", "bbox", "boxes"}
        metadata = {k: v for k, v in row.items() if k not in skip}
        metadata.update(mask=mask, boxes=box, image_size=[width, height], question=question)
        return {"prompt": self.template.format(question=question), "metadata": metadata, "images": [image],
                "video": None}


PLUGIN = ReferringJsonl
