"""Overlays of a segmentation policy's evaluation samples: the input image, the predicted mask (red), the true mask
(green outline), the VLM's boxes (yellow) and points (cyan foreground, magenta background), with its text.

A segmenter reward (`sam_mask`, in this process) declares the artifacts ``mask`` and ``seg_prompts`` and returns the
predicted masks and the parsed prompts in its result (``RewardResult.artifacts``); the text sample writer keeps them
([`keep`]) next to its texts and writes, beside its table, ``step_XXXXX_seg.png`` (a grid of the overlays with prompt
and reward) and ``step_XXXXX_seg.html`` (each overlay beside the full prompt, text and reward) with [`write`].
"""

from __future__ import annotations

import html
from pathlib import Path

import numpy as np
import torch

from .types import PromptBatch, as_list

RED, GREEN, YELLOW = (255, 0, 0), (0, 204, 0), (255, 220, 0)
POINT_COLOURS = {1: (0, 230, 230), 0: (230, 0, 230)}


def keep(texts: list[str], masks: list, prompts: list, batch: PromptBatch, k: int) -> list[dict]:
    """The first `k` samples' predicted mask (`masks`: bool `[H, W]` or `None` each), true mask (``metadata["mask"]``
    when it is an array), parsed prompts (`prompts`: ``{"boxes", "points", "labels"}`` or `None` each), text and input
    image, for [`write`]."""
    pictures = batch.conditions.get("images", [None] * len(batch))
    rows = []
    for i in range(k):
        truth = batch.metadata[i].get("mask")
        truth = torch.as_tensor(np.asarray(truth)) if isinstance(truth, (torch.Tensor, np.ndarray, list)) else None
        image = as_list(pictures[i])
        rows.append({"mask": masks[i], "truth": truth, "prompt": prompts[i], "text": texts[i],
                     "image": image[0] if image else None})
    return rows


def _tint(base: torch.Tensor, mask: torch.Tensor | None, colour, strength: float, outline: bool) -> torch.Tensor:
    """`base` `[3, H, W]` with `mask` (`[h, w]`, resized by nearest neighbour) tinted, or its edge drawn
    (``torchvision.utils.draw_segmentation_masks``: ``base * (1 - strength) + colour * strength`` on the mask)."""
    from torchvision.utils import draw_segmentation_masks

    if mask is None or mask.dim() != 2:
        return base
    m = torch.nn.functional.interpolate(mask.float()[None, None], size=base.shape[-2:], mode="nearest")[0, 0] > 0.5
    if outline:  # pixels of the mask with a neighbour outside it
        padded = torch.nn.functional.pad(m[None, None].float(), (1, 1, 1, 1))
        m = m & (torch.nn.functional.max_pool2d(1 - padded, 3, stride=1)[0, 0] > 0)
    return draw_segmentation_masks(base, m, alpha=strength, colors=colour)


def panel(row: dict) -> torch.Tensor:
    """One overlay `[3, H, W]` in [0, 1] at the input image's size (the mask's size, on grey, without an image):
    boxes by ``torchvision.utils.draw_bounding_boxes``; points as PIL discs of radius 1.5 around their exact
    (fractional) centres (torchvision's ``draw_keypoints`` would move them to whole pixels)."""
    from PIL import Image, ImageDraw
    from torchvision.utils import draw_bounding_boxes

    from .visualize import as_pil

    picture = as_pil(row["image"])
    if picture is None:
        size = tuple(row["mask"].shape[-2:]) if row["mask"] is not None else (32, 32)
        picture = Image.new("RGB", (size[1], size[0]), (128, 128, 128))
    base = torch.from_numpy(np.asarray(picture, dtype=np.float32) / 255).permute(2, 0, 1)  # [3, H, W]
    base = _tint(base, row["mask"], RED, 0.5, outline=False)
    base = _tint(base, row["truth"], GREEN, 1.0, outline=True)
    drawn = (base * 255).round().to(torch.uint8)  # [3, H, W]
    prompt = row["prompt"] or {"boxes": [], "points": [], "labels": []}
    count = min(len(prompt["boxes"]), len(prompt["points"]), len(prompt["labels"]))  # objects: a box, its points
    if count:  # a box's right and bottom edges on its last pixels, never left of its left edge
        boxes = torch.tensor([[b[0], b[1], max(b[0], b[2] - 1), max(b[1], b[3] - 1)] for b in prompt["boxes"][:count]],
                             dtype=torch.float64)  # [K, 4]
        drawn = draw_bounding_boxes(drawn, boxes, colors=YELLOW)
    image = Image.fromarray(drawn.permute(1, 2, 0).numpy().copy())
    draw = ImageDraw.Draw(image)
    for points, labels in zip(prompt["points"][:count], prompt["labels"][:count]):
        for (x, y), label in zip(points, labels):
            draw.ellipse([x - 1.5, y - 1.5, x + 1.5, y + 1.5], fill=POINT_COLOURS.get(label, YELLOW))
    return torch.from_numpy(np.asarray(image, dtype=np.float32) / 255).permute(2, 0, 1)


def write(rows: list[dict], prompts: list[str], folder: Path, step: int, rewards: list[float]) -> list[Path]:
    """``step_XXXXX_seg.png`` (the overlays with prompt and reward) and ``step_XXXXX_seg.html`` (each overlay with the
    full prompt, text and reward); nothing when `rows` is empty."""
    from .visualize import _thumbnail_src, save_image_grid

    if not rows:
        return []
    folder.mkdir(parents=True, exist_ok=True)
    pictures = [panel(row) for row in rows]
    grid, page = folder / f"step_{step:05d}_seg.png", folder / f"step_{step:05d}_seg.html"
    save_image_grid(pictures, [f"{p[:60]}\nr={s:.2f}" for p, s in zip(prompts, rewards)], grid)
    cells = "".join(
        f"<tr><td><img src='{_thumbnail_src(picture, 256)}' alt='overlay'></td><td><pre>{html.escape(p)}</pre></td>"
        f"<td><pre>{html.escape(str(row['text']))}</pre></td><td>{s:.3f}</td></tr>"
        for picture, row, p, s in zip(pictures, rows, prompts, rewards)
    )
    page.write_text(
        "<!doctype html><meta charset='utf-8'><style>body{font-family:sans-serif}td{vertical-align:top;"
        "border-bottom:1px solid #ddd;padding:4px}pre{white-space:pre-wrap;margin:0;max-width:40em}</style>"
        f"<h3>step {step}: predicted mask red, truth green, boxes yellow, points cyan (1) / magenta (0)</h3>"
        f"<p><a href='{grid.name}'>grid</a></p><table><tr><th>overlay</th><th>prompt</th><th>text</th>"
        f"<th>reward</th></tr>{cells}</table>\n", encoding="utf-8")
    return [grid, page]
