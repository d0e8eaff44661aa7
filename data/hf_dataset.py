"""Prompts from a Hugging Face `datasets` dataset (a hub id, or a local folder), the way TRL and EasyR1 users keep them.

Each row of the chosen split becomes a prompt item: the question column formatted by `prompt_template`, the images of
`image_column` (decoded to PIL images by `datasets`) as the condition, and the other columns (or those named in
`metadata_columns`) in the metadata the rewards read (e.g. ``answer`` for `accuracy`, ``boxes`` for `box_iou`). Rows with
a box and an image get ``image_size`` (``[width, height]``), as in `vlm_jsonl`.

Images of an ``Image`` column (or a list of them) are read undecoded first: one over `max_image_pixels` pixels is
refused from its header, naming the row, the image, its size and the option, before it is decoded.

A local folder may be one written by ``Dataset.save_to_disk`` / ``DatasetDict.save_to_disk`` or a folder of data files
(parquet, JSON lines, CSV) that ``datasets.load_dataset`` reads. Needs the optional extra: ``pip install
"mmgrpo[datasets]"``.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path

from mmgrpo.hub import data_path, resolve_pretrained
from mmgrpo.image_files import DEFAULT_MAX_IMAGE_PIXELS, MAX_IMAGE_PIXELS_LIMIT, open_image
from mmgrpo.types import as_list
from mmgrpo.validation import check_fields, check_range, check_template, check_text


@dataclass
class HFDatasetConfig:
    """Options of [`HFDataset`].

    Args:
        path (`str`): a hub dataset id (``org/name``) or a local folder.
        subset (`str`, *optional*): the dataset's configuration name (``load_dataset(path, subset)``).
        revision (`str`, *optional*): a hub revision (branch, tag or commit) to pin.
        train_split (`str`): the split training draws from.
        eval_split (`str`, *optional*): the held-out split (unset: no held-out items).
        question_column (`str`): the column holding the question.
        prompt_template (`str`): ``{question}`` is replaced by the row's question.
        image_column (`str`, *optional*): a column of images (one image or a list per row) passed to the policy.
        metadata_columns (`list[str]`, *optional*): the columns put in each item's metadata (unset: every column but
            the question and the images).
        box_key (`str`): the ground-truth box column; rows with it and an image get ``image_size``.
        max_train_rows (`int`, *optional*): use only the first rows of the training split.
        max_eval_rows (`int`, *optional*): use only the first rows of the held-out split.
        max_image_pixels (`int`, defaults to 67108864): the most pixels (width x height) of one image, read from its
            header; a larger one is refused before decoding. At most 134217728.
    """

    path: str
    subset: str | None = None
    revision: str | None = None
    train_split: str = "train"
    eval_split: str | None = None
    question_column: str = "problem"
    prompt_template: str = "{question}"
    image_column: str | None = None
    metadata_columns: list[str] | None = None
    box_key: str = "boxes"
    max_train_rows: int | None = None
    max_eval_rows: int | None = None
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS

    def __post_init__(self):
        check_fields(self)
        check_range("max_image_pixels", self.max_image_pixels, 1, MAX_IMAGE_PIXELS_LIMIT,
                    fix="the default 67108864 is 8192 x 8192")
        # an existing local folder or a hub id; checked before loading
        resolve_pretrained(data_path(self.path), "data.path", what="dataset")
        for key, value in {"train_split": self.train_split, "question_column": self.question_column,
                           "box_key": self.box_key}.items():
            check_text(key, value)
        if "{question}" not in self.prompt_template:
            raise ValueError(f"data.prompt_template must contain '{{question}}', got {self.prompt_template!r}.")
        check_template("prompt_template", self.prompt_template, question="q")
        for key, value in {"max_train_rows": self.max_train_rows, "max_eval_rows": self.max_eval_rows}.items():
            if value is not None:
                check_range(key, value, 1, 10**9, fix="unset it to use the whole split")
        try:
            import datasets  # noqa: F401
        except ImportError as err:
            raise ValueError('data: the hf_dataset prompt source needs the `datasets` library: pip install '
                             '"mmgrpo[datasets]"') from err


class HFDataset:
    """Prompt items (with images) and ground truth from a `datasets` dataset."""

    Config = HFDatasetConfig
    disjoint_splits = False  # the dataset's splits decide

    def __init__(self, config: HFDatasetConfig):
        self.config = config

    def train_items(self) -> list[dict]:
        return self.read(self.config.train_split, self.config.max_train_rows)

    def eval_items(self) -> list[dict]:
        return self.read(self.config.eval_split, self.config.max_eval_rows) if self.config.eval_split else []

    def eval_splits(self) -> dict[str, list[dict]]:
        return {"eval": self.eval_items()}  # one held-out split

    def load_split(self, split: str):
        """One split of the dataset, from a `save_to_disk` folder, a folder of data files, or the hub."""
        import datasets

        c = self.config
        local = Path(data_path(c.path))
        if (local / "dataset_dict.json").is_file() or (local / "state.json").is_file():
            loaded = datasets.load_from_disk(str(local))
            if isinstance(loaded, datasets.DatasetDict):
                if split not in loaded:
                    raise ValueError(f"data: {c.path} has no split {split!r}; it has {sorted(loaded)}.")
                return loaded[split]
            if split != c.train_split:
                raise ValueError(f"data: {c.path} holds one split (a Dataset); unset eval_split or save a DatasetDict.")
            return loaded
        return datasets.load_dataset(str(local) if local.is_dir() else c.path, c.subset, split=split, revision=c.revision)

    def read(self, split: str, limit: int | None) -> list[dict]:
        """The prompt items of `split` (its first `limit` rows); errors name the dataset, split and row."""
        c = self.config
        rows = self.load_split(split)
        if c.question_column not in rows.column_names:
            raise ValueError(f"data: {c.path} [{split}] has no column {c.question_column!r}; its columns are "
                             f"{rows.column_names}: set data.question_column.")
        missing = [k for k in (c.metadata_columns or []) + ([c.image_column] if c.image_column else [])
                   if k not in rows.column_names]
        if missing:
            raise ValueError(f"data: {c.path} [{split}] has no column(s) {missing}; its columns are {rows.column_names}.")
        if limit is not None:
            rows = rows.select(range(min(limit, len(rows))))
        decoders = {}  # image columns: datasets hands them over undecoded ({"bytes", "path"}), headers checked first
        for name, feature in rows.features.items():
            decoder, undecoded = _image_features(feature)
            if decoder is not None:
                rows, decoders[name] = rows.cast_column(name, undecoded), decoder
        items = []
        for number, row in enumerate(rows):
            try:
                items.append(self.item(row, decoders))
            except ValueError as err:
                raise ValueError(f"data: {c.path} [{split}] row {number}: {err}") from None
        if not items:
            raise ValueError(f"data: {c.path} [{split}] holds no rows.")
        return items

    def image(self, value: dict, decoder, column: str):
        """A PIL image from an undecoded image `value` (``{"bytes", "path"}``) of `column`, decoded by `decoder` (a
        `datasets.Image`) once its header is within `max_image_pixels`."""
        data, path = value.get("bytes"), value.get("path")
        if data is None and path is None:
            raise ValueError(f"an image of column {column!r} has neither bytes nor a path")
        if data is None and not Path(path).is_file():  # a remote file: fetched once, then checked and decoded
            from datasets.utils.file_utils import xopen

            with xopen(path, "rb") as remote:
                data = remote.read()
        with open_image(io.BytesIO(data) if data is not None else path, self.config.max_image_pixels,
                        name=path or f"of column {column!r}"):
            pass  # the header is within the limit
        return decoder.decode_example({"bytes": data, "path": path})

    def item(self, row: dict, decoders: dict | None = None) -> dict:
        """One prompt item of a row; the images of the columns in `decoders` (column -> `datasets.Image`) arrive
        undecoded and are checked, then decoded, here."""
        c, decoders = self.config, decoders or {}

        def value(key):  # a column's value, as datasets would decode it
            if key not in decoders or row[key] is None:
                return row[key]
            if isinstance(row[key], list):
                return [None if v is None else self.image(v, decoders[key], key) for v in row[key]]
            return self.image(row[key], decoders[key], key)

        images = [image.convert("RGB") for image in as_list(value(c.image_column))] if c.image_column else []
        skip = {c.question_column, c.image_column}
        keys = c.metadata_columns if c.metadata_columns is not None else [k for k in row if k not in skip]
        metadata = {key: value(key) for key in keys}
        if c.box_key in metadata and images and "image_size" not in metadata:
            metadata["image_size"] = list(images[0].size)
        return {"prompt": c.prompt_template.format(question=row[c.question_column]), "metadata": metadata,
                "images": images, "video": None}


def _image_features(feature) -> tuple:
    """For a column's `feature`: its `datasets.Image` (decoding) and the same feature with decoding off, or
    ``(None, None)`` for a column that holds no ``Image`` or list of them."""
    import datasets

    if isinstance(feature, datasets.Image):
        return feature, datasets.Image(mode=feature.mode, decode=False)
    if isinstance(feature, datasets.List) and isinstance(feature.feature, datasets.Image):
        inner = feature.feature
        return inner, datasets.List(datasets.Image(mode=inner.mode, decode=False), length=feature.length)
    return None, None


PLUGIN = HFDataset
