"""Vision-language prompts from JSONL (one row per question, with image paths), the format VLM-R1 / R1-V users keep.

A row is ``{"image": "a.png" | ["a.png", "b.png"], "problem": "How many ...?", "answer": "3", ...}``; optional
``"video"`` (a path, or a list of frame paths), and for grounding ``"boxes"`` (``[x1, y1, x2, y2]`` or a list of them,
pixels of the original image). Relative paths are read from `image_root` (default: the JSONL file's folder). Each row
becomes a prompt item: the question formatted by `prompt_template`, the images / video as conditions, and every other
key in the metadata, plus ``image_size`` (``[width, height]`` of the first image, read from its header) for rows with
boxes, so `box_iou` can map boxes between the original image and the model's resized frame.

Every local image and video frame a row names is checked from its header when the file is read: one over
`max_image_pixels` pixels is refused, naming the file, its size and the option, before anything is decoded (a video
file and URIs are read by the pipeline as they are).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from mmgrpo.data._jsonl import image_size, read_items, resolve_media
from mmgrpo.hub import data_path
from mmgrpo.image_files import DEFAULT_MAX_IMAGE_PIXELS, MAX_IMAGE_PIXELS_LIMIT
from mmgrpo.types import as_list
from mmgrpo.validation import check_fields, check_range, check_template, check_text

R1_TEMPLATE = (
    "{question} Output the thinking process in <think> </think> and final answer in <answer> </answer> tags."
)


@dataclass
class VLMJsonlConfig:
    """Options of [`VLMJsonl`].

    Args:
        train_file (`str`): the training JSONL.
        eval_file (`str`, *optional*): held-out rows in the same format.
        image_root (`str`, *optional*): folder of relative image / video paths (default: each file's folder).
        question_key (`str`): the question's key (``"problem"`` as R1-V / EasyR1; ``"question"`` also common).
        prompt_template (`str`): ``{question}`` is replaced by the row's question (default: R1-V's instruction).
        box_key (`str`): the ground-truth box key; rows with it get ``image_size`` in their metadata.
        max_image_pixels (`int`, defaults to 67108864): the most pixels (width x height) of one image or frame, read
            from its header; a larger one is refused before decoding. At most 134217728.
    """

    train_file: str
    eval_file: str | None = None
    image_root: str | None = None
    question_key: str = "problem"
    prompt_template: str = R1_TEMPLATE
    box_key: str = "boxes"
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS

    def __post_init__(self):
        check_fields(self)
        check_range("max_image_pixels", self.max_image_pixels, 1, MAX_IMAGE_PIXELS_LIMIT,
                    fix="the default 67108864 is 8192 x 8192")
        check_text("question_key", self.question_key)
        check_text("box_key", self.box_key)
        if "{question}" not in self.prompt_template:
            raise ValueError(f"data.prompt_template must contain '{{question}}', got {self.prompt_template!r}.")
        check_template("prompt_template", self.prompt_template, question="q")
        if self.image_root is not None and not Path(self.image_root).expanduser().is_dir():
            raise ValueError(f"data.image_root: {self.image_root!r} is not a folder; give the folder of the images.")
        for key, value in {"train_file": self.train_file, "eval_file": self.eval_file}.items():
            if value is not None and not Path(data_path(value)).is_file():
                raise ValueError(f"data.{key}: {value!r} does not exist; give a JSONL file (see data/vlm_jsonl.py).")


class VLMJsonl:
    """Prompt items with images (or video) and ground truth from JSONL files."""

    Config = VLMJsonlConfig
    disjoint_splits = False  # the user's files decide (an example config evaluates on its training file)

    def __init__(self, config: VLMJsonlConfig):
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
        c = self.config
        question = row.get(c.question_key, row.get("question"))
        if question is None:
            raise KeyError(f"the row has no {c.question_key!r} (or 'question') key")
        images = [resolve_media(p, root) for p in as_list(row.get("image", row.get("images")))]
        sizes = [image_size(p, c.max_image_pixels) for p in images]  # headers only; refused beyond the limit
        metadata = {k: v for k, v in row.items() if k not in (c.question_key, "question", "image", "images", "video")}
        if c.box_key in row and sizes and sizes[0] is not None and "image_size" not in metadata:
            metadata["image_size"] = list(sizes[0])
        video = row.get("video")
        if isinstance(video, list):  # frames: images
            video = [resolve_media(p, root) for p in video]
            for frame in video:
                image_size(frame, c.max_image_pixels)
        elif video is not None:  # a video file
            video = resolve_media(video, root)
        # every item has both condition keys (a batch takes its condition keys from its first item)
        return {"prompt": c.prompt_template.format(question=question), "metadata": metadata, "images": images,
                "video": video}



PLUGIN = VLMJsonl
