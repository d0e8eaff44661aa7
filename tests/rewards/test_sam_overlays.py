"""Segmentation overlays: the colours of one panel by hand (predicted mask red, truth outline green, box yellow,
points cyan / magenta), and the text writer of an evaluation writing the grid and the HTML page from the masks and
prompts the segmenter reward declares as artifacts of its result (none with attach_masks: false)."""

import numpy as np
import torch
from PIL import Image

from builders._sam import tiny_sam2_dir  # noqa: F401
from mmgrpo._mask_overlays import panel
from mmgrpo.rewards.sam_mask import SamMask, SamMaskConfig
from mmgrpo.sample_writers import SampleWriter
from mmgrpo.types import PromptBatch


def test_panel_colours_by_hand():
    image = Image.new("RGB", (20, 10), (102, 102, 102))  # grey 0.4
    pred = torch.zeros(10, 20, dtype=torch.bool)
    pred[2:5, 2:5] = True
    truth = torch.zeros(10, 20, dtype=torch.bool)
    truth[1:9, 10:18] = True
    prompt = {"boxes": [[1.0, 1.0, 8.0, 8.0]], "points": [[[3.0, 3.0], [14.0, 5.0]]], "labels": [[1, 0]]}
    out = panel({"image": image, "mask": pred, "truth": truth, "prompt": prompt, "text": ""})
    pixels = (out.permute(1, 2, 0).numpy() * 255).round()  # [H, W, 3]
    assert out.shape == (3, 10, 20)
    np.testing.assert_allclose(pixels[4, 4], [0.5 * 102 + 127.5, 51, 51], atol=1)  # red tint 0.5 over grey
    assert tuple(pixels[1, 12]) == (0, 204, 0)  # truth's top edge: green
    assert tuple(pixels[7, 12]) == (102, 102, 102)  # inside the truth: untouched
    assert tuple(pixels[7, 3]) == (255, 220, 0)  # the box [1, 8) x [1, 8): its last row 7 is its edge, yellow
    assert tuple(pixels[3, 3]) == (0, 230, 230) and tuple(pixels[5, 14]) == (230, 0, 230)  # points


def test_text_writer_writes_segmentation_overlays(tiny_sam2_dir, tmp_path):
    reward = SamMask(SamMaskConfig(model=tiny_sam2_dir, coords="original", device="cpu"))
    truth = torch.zeros(60, 80, dtype=torch.bool)
    truth[10:30, 20:50] = True
    image = Image.fromarray((np.random.default_rng(0).random((60, 80, 3)) * 255).astype(np.uint8))
    batch = PromptBatch(["segment it"], metadata=[{"mask": truth}], conditions={"images": [image]}).repeat(2)
    outputs = {"texts": ['<answer>{"bbox": [20, 10, 50, 30], "points_1": [30, 20], "points_2": [40, 25]}</answer>',
                         "no box"]}
    result = reward(outputs, batch)
    assert list(outputs) == ["texts"]  # the masks travel in the result, declared by the reward
    writer = SampleWriter("text", limit=4, artifacts=reward.artifacts)
    writer.add(outputs, batch, result.artifacts)
    files = writer.write(tmp_path, 7, result.scores.tolist())
    names = sorted(f.name for f in files)
    assert names == ["step_00007.html", "step_00007.jsonl", "step_00007_seg.html", "step_00007_seg.png"]
    page = (tmp_path / "step_00007_seg.html").read_text()
    assert page.count("<img") == 2 and "no box" in page and f"{result.scores[0].item():.3f}" in page
    assert Image.open(tmp_path / "step_00007_seg.png").size[0] > 0
    plain = SampleWriter("text", limit=4)  # a reward declaring no artifacts: the text table only
    plain.add({"texts": ["a", "b"]}, batch, result.artifacts)
    assert sorted(f.name for f in plain.write(tmp_path / "plain", 7, [0.0, 1.0])) == ["step_00007.html",
                                                                                       "step_00007.jsonl"]


def test_attach_masks_false_declares_and_returns_no_artifacts(tiny_sam2_dir):
    config = SamMaskConfig(model=tiny_sam2_dir, coords="original", device="cpu", attach_masks=False)
    assert SamMask.artifacts_for(config) == frozenset() and SamMask.modalities_for(config) == {"text"}
    reward = SamMask(config)
    truth = torch.zeros(60, 80, dtype=torch.bool)
    batch = PromptBatch(["segment it"], metadata=[{"mask": truth}], conditions={"images": [Image.new("RGB", (80, 60))]})
    result = reward({"texts": ['<answer>{"bbox": [20, 10, 50, 30]}</answer>']}, batch)
    assert reward.artifacts == frozenset() and result.artifacts == {}


def _panel_by_hand(image: Image.Image, pred: torch.Tensor, truth: torch.Tensor, prompt: dict) -> torch.Tensor:
    """The overlay as mmgrpo drew it before it used torchvision's drawing utilities: the red tint and the green edge
    blended by hand in float, rounded to bytes, then the box and the point discs drawn with PIL."""
    from PIL import ImageDraw

    base = torch.from_numpy(np.asarray(image, dtype=np.float32) / 255).permute(2, 0, 1)  # [3, H, W]
    base = torch.where(pred[None], base * 0.5 + torch.tensor([1.0, 0.0, 0.0])[:, None, None] * 0.5, base)
    padded = torch.nn.functional.pad(truth[None, None].float(), (1, 1, 1, 1))
    edge = truth & (torch.nn.functional.max_pool2d(1 - padded, 3, stride=1)[0, 0] > 0)
    base = torch.where(edge[None], base * 0.0 + torch.tensor([0.0, 0.8, 0.0])[:, None, None] * 1.0, base)
    drawn = Image.fromarray((base.permute(1, 2, 0).numpy() * 255).round().astype(np.uint8))
    draw = ImageDraw.Draw(drawn)
    for box, points, labels in zip(prompt["boxes"], prompt["points"], prompt["labels"]):
        draw.rectangle([box[0], box[1], max(box[0], box[2] - 1), max(box[1], box[3] - 1)], outline=(255, 220, 0))
        for (x, y), label in zip(points, labels):
            draw.ellipse([x - 1.5, y - 1.5, x + 1.5, y + 1.5], fill={1: (0, 230, 230), 0: (230, 0, 230)}[label])
    return torch.from_numpy(np.asarray(drawn, dtype=np.float32) / 255).permute(2, 0, 1)


def test_panel_through_torchvision_draws_the_same_pixels_as_by_hand():
    """Random picture and masks, fractional and degenerate boxes, points at fractional places and on the border."""
    rng = np.random.default_rng(3)
    image = Image.fromarray((rng.random((37, 53, 3)) * 255).astype(np.uint8))
    pred, truth = torch.from_numpy(rng.random((37, 53)) > 0.6), torch.from_numpy(rng.random((37, 53)) > 0.4)
    prompt = {"boxes": [[3.7, 4.2, 30.9, 25.5], [10.0, 10.0, 10.5, 30.0], [0.3, 0.6, 52.9, 36.9]],
              "points": [[[5.5, 6.7], [20.2, 30.9]], [[11.0, 12.0]], [[0.4, 36.6], [52.5, 0.0]]],
              "labels": [[1, 0], [1], [0, 1]]}
    out = panel({"image": image, "mask": pred, "truth": truth, "prompt": prompt, "text": ""})
    assert torch.equal(out, _panel_by_hand(image, pred, truth, prompt))
