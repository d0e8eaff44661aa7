"""Synthetic referring segmentation: coloured shapes on a black image, a question naming one of them, its exact mask.

Scenes are those of `vlm_shapes` (1-4 circles, squares and triangles, one per quadrant, never overlapping, drawn from
the item's index alone). The target's mask is the shape drawn alone with the same drawing call, so it holds exactly
the pixels of the shape in the image. Questions (each asked only when it names one shape):

- ``colour_shape``: "the red triangle" (the only red triangle);
- ``shape``: "the circle" (the only circle);
- ``largest``: "the largest blue shape" (several blue shapes; a small reasoning step: compare their sizes; the largest
  is larger than the others by at least `min_margin` pixels).

The prompt template wraps the expression (``seg_r1``: 'Segment "the red triangle". ...').

Items carry ``images`` (one PIL image) and metadata ``mask`` (bool `[size, size]`), ``boxes`` (the mask's tight box
``[x1, y1, x2, y2]``), ``image_size``, ``question`` and ``task``, plus ``"completion"`` with `with_targets`: the
supervised answer in Seg-Zero's layout (what ``mmgrpo sft`` and TempSamp's ground-truth member use),

    <think>top left red circle, top right none, bottom left blue square, bottom right red triangle: bottom
    right</think><answer>{"bbox": [x1, y1, x2, y2], "points_1": [x, y], "points_2": [x, y]}</answer>

(``thought: labelled``: each quadrant followed by the shape in it, then the quadrant of the named one;
``thought: list``: the four shapes without their quadrants' names; ``thought: match``: the quadrants in reading order up
to the named shape's, each with its shape and whether it is the one asked for, ``top left blue circle no, top right red
triangle yes``), with the tight box and two points well inside the mask, whole pixels. Held-out items use scene
indices disjoint from the training ones. The prompt is `prompt_template` (``"seg_zero"``, ``"seg_r1"`` or a template
with ``{question}``). Metadata ``combination`` is the question's ``[kind, target shape, target colour]``.

With ``ood: true`` the source also declares the held-out split ``ood``: questions whose combination is one of
`HELD_OUT` (the unseen-combination rule of `shapes_edit`: 9 of the 36 kind x shape x colour combinations, each
(kind, shape) with one colour), which no training or ``eval`` question asks; every kind, shape and colour alone still
occurs in training. Without it, nothing is held out by combination.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field

import numpy as np
import torch

from mmgrpo.data.referring_jsonl import TEMPLATES, tight_box
from mmgrpo.data._held_out import EVAL_OFFSET, OOD, OOD_OFFSET, SEED_STRIDE, held_out_combinations, items_by_rule
from mmgrpo.data.vlm_shapes import COLOURS, SHAPES, render, scene
from mmgrpo.validation import check_fields, check_range, check_seed, check_template

QUESTIONS = ("colour_shape", "shape", "largest")
# (question kind, target shape, target colour) combinations asked only in the `ood` split under `ood: true`
HELD_OUT = held_out_combinations(QUESTIONS, SHAPES, tuple(COLOURS))
QUADRANTS = ("top left", "top right", "bottom left", "bottom right")
THOUGHTS = ("labelled", "list", "match")


@dataclass
class SegShapesConfig:
    """Options of [`SegShapes`].

    Args:
        questions (`list[str]`): question kinds, from ``colour_shape``, ``shape`` and ``largest``.
        n_train (`int`), n_eval (`int`): numbers of training and held-out items.
        size (`int`): image side in pixels.
        min_margin (`int`): a ``largest`` question needs its target larger than the others by this many pixels.
        prompt_template (`str`): ``"seg_zero"``, ``"seg_r1"`` or a template with ``{question}``.
        seed (`int`): offsets the scene indices (another seed, other images).
        with_targets (`bool`): add the supervised answer to each item's metadata under ``"completion"``.
        thought (`str`): the inventory in the target's ``<think>``: ``"labelled"``, ``"list"`` or ``"match"`` (module
            docstring).
        ood (`bool`): hold the combinations of `HELD_OUT` out of training and ``eval`` and declare the held-out split
            ``ood`` (`n_eval` questions asking them).
    """

    questions: list[str] = field(default_factory=lambda: list(QUESTIONS))
    n_train: int = 2000
    n_eval: int = 200
    size: int = 56
    min_margin: int = 20
    prompt_template: str = "seg_zero"
    seed: int = 0
    with_targets: bool = False
    thought: str = "labelled"
    ood: bool = False

    def __post_init__(self):
        check_fields(self)
        check_seed("seed", self.seed)
        check_range("n_train", self.n_train, 0, 10**5, fix="items are built in memory; training needs some")
        check_range("n_eval", self.n_eval, 0, 10**5, fix="0: no held-out items (then set eval.every=0)")
        check_range("size", self.size, 28, 1024)
        check_range("min_margin", self.min_margin, 0, self.size**2, fix="an area margin in pixels, at most the image's")
        check_template("prompt_template", TEMPLATES.get(self.prompt_template, self.prompt_template), question="q")
        if not self.questions or set(self.questions) - set(QUESTIONS):
            raise ValueError(f"data.questions must be a non-empty subset of {list(QUESTIONS)}, got {self.questions}.")
        if self.thought not in THOUGHTS:
            raise ValueError(f"data.thought must be one of {list(THOUGHTS)}, got {self.thought!r}.")


def shape_mask(shape: dict, size: int) -> torch.Tensor:
    """The exact pixels of one shape: bool `[size, size]` (the shape drawn alone, non-black)."""
    return torch.from_numpy(np.asarray(render([shape], size)).any(axis=-1))


def interior_points(mask: torch.Tensor, box: list[float]) -> list[list[int]]:
    """Two pixels well inside the bool mask `[H, W]`: the interior pixels (whose 3 x 3 neighbourhood is all mask)
    nearest to the points a sixth of the box height above and below the mask's centroid, as ``[[x, y], [x, y]]``."""
    m = mask.float()[None, None]  # [1, 1, H, W]
    inner = torch.nn.functional.max_pool2d(1 - m, 3, stride=1, padding=1)[0, 0] == 0  # [H, W] eroded
    ys, xs = torch.nonzero(inner if inner.any() else mask, as_tuple=True)
    cy, cx = ys.float().mean(), xs.float().mean()
    sixth = (box[3] - box[1]) / 6
    points = []
    for ty in (cy - sixth, cy + sixth):
        k = int(((xs - cx) ** 2 + (ys - ty) ** 2).argmin())
        points.append([int(xs[k]), int(ys[k])])
    return points


def target_quadrant(metadata: dict) -> int:
    """The index in `QUADRANTS` of the quadrant holding the centre of an item's target box (0: top left, 3: bottom
    right)."""
    box = [int(round(v)) for v in metadata["boxes"]]
    width, height = metadata["image_size"]
    centre_x, centre_y = (box[0] + box[2]) / 2, (box[1] + box[3]) / 2
    return 2 * int(centre_y >= height / 2) + int(centre_x >= width / 2)


def target_text(metadata: dict, shapes: list[dict], thought: str = "labelled") -> str:
    """The supervised completion of an item with `metadata` whose scene holds `shapes` (module docstring)."""
    by_cell = {s["cell"]: f"{s['colour']} {s['shape']}" for s in shapes}
    box = [int(round(v)) for v in metadata["boxes"]]
    target = target_quadrant(metadata)
    if thought == "match":  # each quadrant up to the target's, answered "no" or "yes"
        thought_text = ", ".join(f"{QUADRANTS[c]} {by_cell.get(c, 'none')} {'yes' if c == target else 'no'}"
                                 for c in range(target + 1))
    else:  # the four quadrants in reading order (labelled: each after its name), then the target's quadrant
        seen = [f"{QUADRANTS[c]} {by_cell.get(c, 'none')}" if thought == "labelled" else by_cell.get(c, "none")
                for c in range(4)]
        thought_text = ", ".join(seen) + f": {QUADRANTS[target]}"
    p1, p2 = interior_points(metadata["mask"], metadata["boxes"])
    answer = json.dumps({"bbox": box, "points_1": p1, "points_2": p2})
    return f"<think>{thought_text}</think><answer>{answer}</answer>"


def pick(index: int, shapes: list[dict], masks: list[torch.Tensor], kinds: list[str], margin: int,
         allowed=lambda combo: True):
    """The question of scene `index`: ``(kind, referring expression, target index)``, or None when no asked kind names
    one shape in a combination (kind, shape, colour) that `allowed` accepts."""
    rng = random.Random(20_000_003 + index)
    options = []
    for k, s in enumerate(shapes):
        same = [t for t in shapes if t["colour"] == s["colour"] and t["shape"] == s["shape"]]
        if "colour_shape" in kinds and len(same) == 1:
            options.append(("colour_shape", f"the {s['colour']} {s['shape']}", k))
        if "shape" in kinds and sum(t["shape"] == s["shape"] for t in shapes) == 1:
            options.append(("shape", f"the {s['shape']}", k))
        rivals = [j for j, t in enumerate(shapes) if t["colour"] == s["colour"] and j != k]
        area = int(masks[k].sum())
        if "largest" in kinds and rivals and all(area >= int(masks[j].sum()) + margin for j in rivals):
            options.append(("largest", f"the largest {s['colour']} shape", k))
    options = [o for o in options if allowed((o[0], shapes[o[2]]["shape"], shapes[o[2]]["colour"]))]
    if not options:
        return None
    preferred = [o for o in options if o[0] == rng.choice(kinds)]  # each kind about equally often where it applies
    return rng.choice(preferred or options)


class SegShapes:
    """The synthetic referring-segmentation task as a prompt source."""

    Config = SegShapesConfig
    disjoint_splits = True  # held-out items come from other scene indices than the training items

    def __init__(self, config: SegShapesConfig):
        self.config = config
        self.template = TEMPLATES.get(config.prompt_template, config.prompt_template)

    def item(self, index: int, held_out: bool = False) -> dict | None:
        """The item of scene `index`, or None when no question names one of its shapes (with `ood`: in a combination
        of `HELD_OUT` when `held_out`, else in none)."""
        c = self.config
        shapes = scene(index, c.size)
        masks = [shape_mask(s, c.size) for s in shapes]
        allowed = (lambda combo: (combo in HELD_OUT) == held_out) if c.ood else (lambda combo: True)
        chosen = pick(index, shapes, masks, c.questions, c.min_margin, allowed)
        if chosen is None:
            return None
        kind, question, target = chosen
        metadata = {"mask": masks[target], "boxes": tight_box(masks[target]), "image_size": [c.size, c.size],
                    "question": question, "task": kind,
                    "combination": [kind, shapes[target]["shape"], shapes[target]["colour"]]}
        if c.with_targets:
            metadata["completion"] = target_text(metadata, shapes, c.thought)
        return {"prompt": self.template.format(question=question), "metadata": metadata,
                "images": [render(shapes, c.size)]}

    def train_items(self) -> list[dict]:
        return items_by_rule(self.item, self.config.seed * SEED_STRIDE, self.config.n_train)

    def eval_items(self) -> list[dict]:  # disjoint scene indices
        return items_by_rule(self.item, self.config.seed * SEED_STRIDE + EVAL_OFFSET, self.config.n_eval)

    def eval_splits(self) -> dict[str, list[dict]]:
        """``eval``, and ``ood`` with `ood` (module docstring)."""
        splits = {"eval": self.eval_items()}
        if self.config.ood:
            splits[OOD] = items_by_rule(lambda index: self.item(index, held_out=True),
                                        self.config.seed * SEED_STRIDE + OOD_OFFSET, self.config.n_eval)
        return splits


PLUGIN = SegShapes
