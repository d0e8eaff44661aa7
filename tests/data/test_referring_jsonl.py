"""The referring-segmentation JSONL prompt source: masks from PNG, compressed COCO RLE and COCO polygons agree with the
pixels of the shipped example images, boxes (given, xywh, or the mask's tight box), sizes, templates, and errors that
name the file and line."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from mmgrpo.data.referring_jsonl import TEMPLATES, ReferringJsonl, ReferringJsonlConfig
from mmgrpo.prompt_stream import items_to_batch
from mmgrpo.rewards.seg_zero import SegZero, SegZeroConfig

EXAMPLE = Path(__file__).resolve().parents[2] / "data" / "examples" / "seg" / "referring.jsonl"
COLOURS = {"the red square": (220, 30, 30), "the blue circle": (30, 60, 220), "the green triangle": (40, 170, 60)}


def test_example_masks_cover_exactly_the_pixels_of_their_shape():
    items = ReferringJsonl(ReferringJsonlConfig(train_file=str(EXAMPLE))).train_items()
    assert [i["metadata"]["question"] for i in items] == list(COLOURS)  # PNG, compressed RLE, polygons
    for item in items:
        metadata = item["metadata"]
        pixels = np.asarray(Image.open(item["images"][0]).convert("RGB"))
        shape = torch.from_numpy((pixels == COLOURS[metadata["question"]]).all(axis=-1))  # [H, W]
        assert metadata["mask"].dtype == torch.bool and torch.equal(metadata["mask"], shape)
        assert metadata["image_size"] == [96, 64]
        assert item["prompt"] == TEMPLATES["seg_zero"].format(question=metadata["question"])
    assert items[0]["metadata"]["mask"].sum() == 24 * 24 and items[0]["metadata"]["boxes"] == [10, 12, 34, 36]
    # no box in the row: the mask's tight box (the circle drawn in [50, 79] x [20, 49], inclusive)
    assert items[1]["metadata"]["boxes"] == [50, 20, 80, 50]


def _write(tmp_path, rows, **options):
    Image.new("RGB", (8, 6)).save(tmp_path / "im.png")
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return ReferringJsonl(ReferringJsonlConfig(train_file=str(path), **options)).train_items()


def test_xywh_boxes_templates_and_extra_keys(tmp_path):
    row = {"image": "im.png", "expression": "it", "mask": {"size": [6, 8], "counts": [6, 12, 30]},
           "bbox": [1, 0, 2, 6], "points": [[1.5, 3]]}
    item = _write(tmp_path, [row], box_format="xywh", prompt_template="seg_r1")[0]
    assert item["metadata"]["boxes"] == [1, 0, 3, 6]
    assert item["metadata"]["mask"].sum() == 12 and item["metadata"]["mask"][:, 1:3].all()  # columns 1-2, rows 0-5
    assert item["metadata"]["points"] == [[1.5, 3]] and item["prompt"].startswith('Segment "it"')
    assert _write(tmp_path, [row], prompt_template="find {question}!")[0]["prompt"] == "find it!"


@pytest.mark.parametrize("row, message", [
    ({"image": "im.png", "problem": "x", "mask": {"size": [5, 8], "counts": [40]}}, r"rows.jsonl:1: .*8x5.*8x6"),
    ({"image": "im.png", "mask": {"size": [6, 8], "counts": [48]}}, r"rows.jsonl:1: .*no 'problem'"),
    ({"image": "im.png", "problem": "x"}, r"rows.jsonl:1: .*no 'mask'"),
    ({"image": "im.png", "problem": "x", "mask": {"size": [6, 8], "counts": [48]}}, r"empty.*bbox"),
    ({"image": "gone.png", "problem": "x", "mask": "m.png"}, r"gone.png.*not found"),
])
def test_bad_rows_name_the_file_and_line(tmp_path, row, message):
    with pytest.raises(ValueError, match=message):
        _write(tmp_path, [row])


def test_bad_options_are_refused_before_reading(tmp_path):
    with pytest.raises(ValueError, match="prompt_template"):
        ReferringJsonlConfig(train_file=str(EXAMPLE), prompt_template="no placeholder")
    with pytest.raises(ValueError, match="train_file"):
        ReferringJsonlConfig(train_file=str(tmp_path / "none.jsonl"))


def test_items_feed_the_segmentation_rewards():
    items = ReferringJsonl(ReferringJsonlConfig(train_file=str(EXAMPLE))).train_items()
    batch = items_to_batch(items)
    texts = ['<think>a</think><answer>{"bbox": %s, "points_1": [%d, %d], "points_2": [%d, %d]}</answer>'
             % (json.dumps(i["metadata"]["boxes"]), i["metadata"]["boxes"][0] + 2, i["metadata"]["boxes"][1] + 2,
                i["metadata"]["boxes"][2] - 2, i["metadata"]["boxes"][3] - 2) for i in items]
    result = SegZero(SegZeroConfig(coords="original"))({"texts": texts}, batch)
    assert result.scores.tolist() == [5.0, 5.0, 5.0]
