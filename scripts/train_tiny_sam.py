"""Trains the tiny SAM 2 (a transformers `Sam2Model` of the tests' builder, `tests/builders/_sam.py`) to segment the
rendered shapes of `seg_shapes` from box and point prompts.

``python scripts/train_tiny_sam.py [--output data/weights/tiny_sam2] [--steps 3000]`` from the repository root. Every
shape of every training scene is a target; each example prompts it with its tight box (each side moved by up to
`--box-jitter` pixels), half of them also with one or two points drawn inside its mask. The loss is a per-pixel binary
cross-entropy plus a soft Dice loss on SAM's low-resolution mask logits (the single-mask output) against the target mask
averaged down to that resolution. Pixels are prepared as the processor does (bilinear resize to the input side, scaled
to [0, 1], normalised with its mean and std) in torch, in batches.

Evaluation is the reward's own path: the saved folder is loaded by the `sam_mask` reward, which prompts every
held-out target with its true tight box only (no points) in batched decoder calls and up-samples the masks with the
processor's ``post_process_masks``; the reported number is the mean IoU over the held-out targets (``miou_box``).
Writes the model and processor (``save_pretrained``) and ``metrics.json`` (loss and mIoU curve, settings, seconds).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the tiny-model builders (tests/builders/)

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from builders._sam import tiny_sam2_config  # noqa: E402
from mmgrpo.data.referring_jsonl import tight_box  # noqa: E402
from mmgrpo.data.seg_shapes import shape_mask  # noqa: E402
from mmgrpo.data.vlm_shapes import render, scene  # noqa: E402


def targets(first: int, count: int, size: int) -> list[tuple[np.ndarray, torch.Tensor, list[float]]]:
    """``(image uint8 [H, W, 3], mask bool [H, W], tight box)`` for every shape of scenes ``first .. first + count``."""
    out = []
    for index in range(first, first + count):
        shapes = scene(index, size)
        image = np.asarray(render(shapes, size))
        for shape in shapes:
            mask = shape_mask(shape, size)
            out.append((image, mask, tight_box(mask)))
    return out


def prompts(batch, rng: random.Random, jitter: float, side: int, size: int):
    """SAM inputs of a batch in the model's input frame (`side` pixels): boxes `[B, 1, 4]`, points `[B, 1, 2, 2]`,
    labels `[B, 1, 2]` (-10 pads an absent point, as the processor); every example has its box (as the answers the
    reward reads), half of them also one or two points inside the mask."""
    scale = side / size
    boxes, points, labels = [], [], []
    for _, mask, box in batch:
        kind = rng.choice(("box", "both"))
        jittered = [v + rng.uniform(-jitter, jitter) for v in box]
        ys, xs = torch.nonzero(mask, as_tuple=True)
        chosen = [rng.randrange(len(xs)) for _ in range(rng.choice((1, 2)))] if kind != "box" else []
        pts = [[float(xs[j]) + 0.5, float(ys[j]) + 0.5] for j in chosen]
        boxes.append([v * scale for v in jittered])
        points.append([[x * scale, y * scale] for x, y in pts] + [[-10.0, -10.0]] * (2 - len(pts)))
        labels.append([1] * len(pts) + [-10] * (2 - len(pts)))
    return (torch.tensor(boxes)[:, None], torch.tensor(points)[:, None], torch.tensor(labels)[:, None])


def pixels(batch, processor, side: int) -> torch.Tensor:
    """Images as the processor prepares them: `[B, 3, side, side]`."""
    images = torch.from_numpy(np.stack([b[0] for b in batch])).permute(0, 3, 1, 2).float() / 255  # [B, 3, H, W]
    images = F.interpolate(images, size=(side, side), mode="bilinear", align_corners=False)
    mean = torch.tensor(processor.image_processor.image_mean)[None, :, None, None]
    std = torch.tensor(processor.image_processor.image_std)[None, :, None, None]
    return (images - mean) / std


def loss_of(model, batch, processor, rng, args) -> torch.Tensor:
    boxes, points, labels = prompts(batch, rng, args.box_jitter, args.side, args.size)
    out = model(pixel_values=pixels(batch, processor, args.side), input_boxes=boxes, input_points=points,
                input_labels=labels, multimask_output=False)
    logits = out.pred_masks[:, 0, 0]  # [B, h, w]
    truth = torch.stack([b[1] for b in batch]).float()[:, None]  # [B, 1, H, W]
    truth = F.interpolate(truth, size=logits.shape[-2:], mode="area")[:, 0]  # [B, h, w] soft
    bce = F.binary_cross_entropy_with_logits(logits, truth)
    prob = logits.sigmoid()
    dice = 1 - (2 * (prob * truth).sum((1, 2)) + 1) / (prob.sum((1, 2)) + truth.sum((1, 2)) + 1)
    return bce + dice.mean()


def evaluate(folder: Path, held_out, batch: int = 64) -> float:
    """Mean IoU of the held-out targets prompted with their true box, through the `sam_mask` reward's decoding."""
    from PIL import Image

    from mmgrpo.rewards.sam_mask import SamMask, SamMaskConfig

    reward = SamMask(SamMaskConfig(model=str(folder), coords="original", device="cpu", decode_batch=batch))
    ious = []
    for start in range(0, len(held_out), batch):
        chunk = held_out[start : start + batch]
        images = [Image.fromarray(image) for image, _, _ in chunk]
        embeddings = reward.embed(images)
        rows = [(i, box, [], []) for i, (_, _, box) in enumerate(chunk)]
        masks = reward.segment(embeddings, rows, [[im.height, im.width] for im in images])
        for mask, (_, truth, _) in zip(masks, chunk):
            ious.append(float((mask & truth).sum()) / max(1.0, float((mask | truth).sum())))
    return float(np.mean(ious))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", default="data/weights/tiny_sam2")
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--scenes", type=int, default=3000)
    parser.add_argument("--eval-scenes", type=int, default=150)
    parser.add_argument("--eval-every", type=int, default=500)
    parser.add_argument("--size", type=int, default=56, help="scene side (pixels), as seg_shapes")
    parser.add_argument("--side", type=int, default=128, help="SAM's input side (pixels)")
    parser.add_argument("--box-jitter", type=float, default=2.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    from transformers import Sam2ImageProcessor, Sam2Model, Sam2Processor

    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    output = Path(args.output)
    output.mkdir(parents=True, exist_ok=True)
    config = tiny_sam2_config(args.side)
    # answer with the single-mask token it is trained on: with the default dynamic selection, an evaluation falls back
    # to SAM's untrained multimask tokens whenever the single mask is judged unstable
    config.mask_decoder_config.dynamic_multimask_via_stability = False
    model = Sam2Model(config).train()
    processor = Sam2Processor(image_processor=Sam2ImageProcessor(size={"height": args.side, "width": args.side}))
    train = targets(0, args.scenes, args.size)
    held_out = targets(500_000, args.eval_scenes, args.size)  # the seg_shapes held-out scene indices
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    warmup = max(1, args.steps // 20)  # linear warm-up, then cosine decay to 0
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min((s + 1) / warmup, 0.5 * (1 + math.cos(
        math.pi * min(1.0, s / args.steps)))))
    curve, started, losses = [], time.time(), []
    for step in range(1, args.steps + 1):
        loss = loss_of(model, rng.sample(train, args.batch), processor, rng, args)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        losses.append(loss.item())
        if step % args.eval_every == 0 or step == args.steps:
            model.eval().save_pretrained(output)
            processor.save_pretrained(output)
            miou = evaluate(output, held_out)
            model.train()
            curve.append({"step": step, "loss": float(np.mean(losses)), "miou_box": miou,
                          "seconds": round(time.time() - started, 1)})
            losses = []
            print(json.dumps(curve[-1]), flush=True)
    summary = {"miou_box": curve[-1]["miou_box"], "curve": curve, "train_targets": len(train),
               "held_out_targets": len(held_out), "parameters": sum(p.numel() for p in model.parameters()),
               "settings": vars(args)}
    (output / "metrics.json").write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
