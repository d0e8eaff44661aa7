"""Ground-truth mask encodings (COCO RLE with integer and compressed counts, polygons, PNG files) and the gIoU / cIoU
metrics, against hand-computed cases."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from mmgrpo.rewards._seg_masks import (
    giou_ciou, load_mask, polygons_to_mask, rle_counts_from_string, rle_counts_to_string, rle_decode, rle_encode,
)


def test_rle_runs_go_down_the_columns_starting_with_background():
    # 2 x 3 image, column-major pixel order (0,0) (1,0) (0,1) (1,1) (0,2) (1,2): 1 background, 2 foreground,
    # 3 background
    mask = rle_decode({"size": [2, 3], "counts": [1, 2, 3]})
    assert mask.tolist() == [[False, True, False], [True, False, False]]
    assert rle_encode(mask) == {"size": [2, 3], "counts": [1, 2, 3]}
    # a mask starting with foreground starts with an empty background run
    assert rle_encode(torch.tensor([[True, False]]))["counts"] == [0, 1, 1]


@pytest.mark.parametrize("counts, text", [
    ([1, 2, 3], "123"),  # small counts: one character each, '0' + count
    ([5, 3, 2, 7], "5324"),  # the fourth is stored as 7 - 3 = 4
    ([5, 3, 2, 1], "532N"),  # 1 - 3 = -2: chunk -2 & 31 = 30 with the sign bit, '0' + 30 = 'N'
    ([40], "X1"),  # 40 & 31 = 8 and 40 >> 5 = 1: 48 + (8 | 32) = "X" (more follows), then 48 + 1 = "1"
])
def test_compressed_rle_counts_by_hand(counts, text):
    assert rle_counts_to_string(counts) == text
    assert rle_counts_from_string(text) == counts


def test_a_compressed_rle_decodes_like_its_integer_counts():
    assert torch.equal(rle_decode({"size": [2, 3], "counts": "123"}), rle_decode({"size": [2, 3], "counts": [1, 2, 3]}))
    with pytest.raises(ValueError, match="needs 6"):
        rle_decode({"size": [2, 3], "counts": [1, 2]})


@settings(max_examples=60, deadline=None, derandomize=True)
@given(st.integers(1, 9), st.integers(1, 9), st.integers(0, 2**31))
def test_rle_round_trips(height, width, seed):
    mask = torch.rand(height, width, generator=torch.Generator().manual_seed(seed)) > 0.5
    rle = rle_encode(mask)
    assert torch.equal(rle_decode(rle), mask)
    assert torch.equal(rle_decode({"size": rle["size"], "counts": rle_counts_to_string(rle["counts"])}), mask)


def test_polygons_cover_the_pixels_whose_centres_are_inside():
    square = polygons_to_mask([[0, 0, 4, 0, 4, 4, 0, 4]], 6, 6)
    expected = torch.zeros(6, 6, dtype=torch.bool)
    expected[:4, :4] = True
    assert torch.equal(square, expected)
    # right triangle (0,0) (4,0) (0,4): centre (c + .5, r + .5) inside when c + r + 1 < 4, i.e. c + r <= 2
    triangle = polygons_to_mask([[0, 0, 4, 0, 0, 4]], 5, 5)
    assert triangle.tolist() == [[c + r <= 2 for c in range(5)] for r in range(5)]
    # two polygons of one object are united; a polygon reaching outside is cut at the image
    both = polygons_to_mask([[0, 0, 2, 0, 2, 2, 0, 2], [3, 3, 9, 3, 9, 9, 3, 9]], 5, 5)
    assert int(both.sum()) == 4 + 4 and bool(both[4, 4]) and not bool(both[2, 2])


def test_load_mask_reads_every_encoding(tmp_path):
    truth = torch.zeros(4, 5, dtype=torch.bool)
    truth[1:3, 2:4] = True
    Image.fromarray(truth.numpy().astype(np.uint8) * 255).save(tmp_path / "m.png")
    assert torch.equal(load_mask("m.png", root=tmp_path), truth)
    assert torch.equal(load_mask(rle_encode(truth)), truth)
    assert torch.equal(load_mask({"polygons": [[2, 1, 4, 1, 4, 3, 2, 3]], "size": [4, 5]}), truth)
    assert torch.equal(load_mask({"polygons": [[2, 1, 4, 1, 4, 3, 2, 3]]}, size=(4, 5)), truth)
    assert torch.equal(load_mask(truth.int().tolist()), truth)
    with pytest.raises(ValueError, match="not found"):
        load_mask("missing.png", root=tmp_path)
    with pytest.raises(ValueError, match="image size"):
        load_mask({"polygons": [[0, 0, 1, 0, 1, 1]]})
    with pytest.raises(ValueError, match=r"\[H, W\]"):
        load_mask([1, 2, 3])


def test_giou_is_the_mean_of_ious_and_ciou_the_ratio_of_sums():
    # image 1: 10 of 20 pixels (IoU 0.5); image 2: 90 of 100 (0.9); image 3: both empty (1)
    giou, ciou = giou_ciou([10, 90, 0], [20, 100, 0])
    assert giou == pytest.approx((0.5 + 0.9 + 1.0) / 3)
    assert ciou == pytest.approx(100 / 120)
    assert giou_ciou([0], [0]) == (1.0, 1.0)
