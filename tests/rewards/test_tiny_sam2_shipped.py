"""The shipped tiny SAM 2 (``mmgrpo:tiny_sam2``, trained by ``scripts/train_tiny_sam.py``) loads in the `sam_mask`
reward and segments held-out `seg_shapes` targets from Seg-Zero answers that give their true box; the box decides
which shape is segmented (another shape's box scores near 0 against the target)."""

import json
from pathlib import Path

import pytest
import torch

from mmgrpo.data.seg_shapes import SegShapes, SegShapesConfig
from mmgrpo.hub import resolve_pretrained
from mmgrpo.prompt_stream import items_to_batch
from mmgrpo.rewards.sam_mask import SamMask, SamMaskConfig


def _answer(box, points=()):
    fields = {"bbox": [round(v) for v in box]}
    fields.update({f"points_{k + 1}": p for k, p in enumerate(points)})
    return f"<think>x</think><answer>{json.dumps(fields)}</answer>"


@pytest.fixture(scope="module")
def setup():
    reward = SamMask(SamMaskConfig(model="mmgrpo:tiny_sam2", coords="original", device="cpu"))
    items = SegShapes(SegShapesConfig(n_train=0, n_eval=24)).eval_items()
    batch = items_to_batch(items)
    batch.group_ids = torch.arange(len(batch))
    return reward, items, batch


def test_shipped_sam_is_a_saved_sam2_with_its_metrics():
    folder = Path(resolve_pretrained("mmgrpo:tiny_sam2", "reward.model"))
    metrics = json.loads((folder / "metrics.json").read_text(encoding="utf-8"))
    assert metrics["miou_box"] >= 0.8 and (folder / "model.safetensors").stat().st_size < 5_000_000


def test_true_boxes_segment_the_named_shape(setup):
    reward, items, batch = setup
    result = reward({"texts": [_answer(it["metadata"]["boxes"]) for it in items]}, batch)
    iou = result.components["iou"]  # [N]
    assert float(iou.mean()) > 0.7 and float(iou.min()) > 0.3
    assert float(result.components["no_box"].sum()) == 0


def test_the_box_decides_which_shape(setup):
    reward, items, batch = setup
    # the box moved to the diagonally opposite quadrant: that region holds another shape or nothing
    size = items[0]["metadata"]["image_size"][0]
    moved = []
    for it in items:
        x1, y1, x2, y2 = it["metadata"]["boxes"]
        dx = size / 2 if (x1 + x2) / 2 < size / 2 else -size / 2
        dy = size / 2 if (y1 + y2) / 2 < size / 2 else -size / 2
        moved.append(_answer([x1 + dx, y1 + dy, x2 + dx, y2 + dy]))
    result = reward({"texts": moved}, batch)
    assert float(result.components["iou"].mean()) < 0.1


def test_shipped_sam_encodes_prompts_and_pixels_in_one_fourier_basis(setup):
    reward = setup[0]
    image_basis = reward.model.shared_image_embedding.positional_embedding  # [2, hidden / 2]
    assert torch.equal(reward.model.prompt_encoder.shared_embedding.positional_embedding, image_basis)
