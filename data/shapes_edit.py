"""Synthetic image editing on shapes scenes: an input scene, an instruction, and the edited scene as ground truth.

Scenes are those of `vlm_shapes` (1-4 circles, squares and triangles on black, one per quadrant, drawn from the item's
index alone). Each item edits one shape, named so the instruction points at it alone (by its shape when no other
shape of the scene has it, else by colour and shape):

- ``recolor``: "make the red circle blue" (the shape redrawn in another colour of the palette);
- ``remove``: "remove the square" (the shape left out).

Items carry ``images`` (the input scene, one PIL image) and metadata ``kind``, ``scene`` and ``target_scene`` (the
shapes before and after, JSON-able), and ``source_image`` / ``target_image`` (uint8 tensors `[3, size, size]`), which
`edit_fidelity` compares the edited image with. Training items use even scene indices, held-out items odd ones (disjoint splits).
"""

from __future__ import annotations

import copy
import random
from dataclasses import dataclass

import numpy as np
import torch

from mmgrpo.data.vlm_shapes import COLOURS, render, scene
from mmgrpo.validation import check_fields, check_range, check_seed

KINDS = ("recolor", "remove")


@dataclass
class ShapesEditConfig:
    """Options of [`ShapesEdit`].

    Args:
        seed (`int`, defaults to 0): offset of the scene indices (a different seed gives other scenes).
        n_train (`int`, defaults to 1000): training items.
        n_eval (`int`, defaults to 100): held-out items.
        size (`int`, defaults to 64): image side in pixels (at least 28).
        kinds (`tuple[str, ...]`, defaults to both): edit kinds among ``recolor`` and ``remove``, taken in turn.
        max_objects (`int`, defaults to 3): most shapes in a scene (1 to 4).
    """

    seed: int = 0
    n_train: int = 1000
    n_eval: int = 100
    size: int = 64
    kinds: tuple[str, ...] = KINDS
    max_objects: int = 3

    def __post_init__(self):
        check_fields(self)
        check_seed("seed", self.seed)
        check_range("n_train", self.n_train, 0, 10**6, fix="items are built in memory")
        check_range("n_eval", self.n_eval, 0, 10**6, fix="0: no held-out items (then set eval.every=0)")
        check_range("size", self.size, 28, 1024, fix="a scene needs at least 28 pixels")
        check_range("max_objects", self.max_objects, 1, 4, fix="one shape per quadrant")
        self.kinds = tuple(self.kinds)
        unknown = sorted(set(self.kinds) - set(KINDS))
        if unknown or not self.kinds:
            raise ValueError(f"data.kinds must be a non-empty subset of {list(KINDS)}, got {list(self.kinds)}.")


def name_of(shapes: list[dict], k: int) -> str:
    """How the instruction names shape `k`: its shape alone when unique in the scene, else colour and shape."""
    target = shapes[k]
    if sum(s["shape"] == target["shape"] for s in shapes) == 1:
        return f"the {target['shape']}"
    return f"the {target['colour']} {target['shape']}"


def edit(shapes: list[dict], kind: str, rng: random.Random) -> tuple[str, list[dict]] | None:
    """``(instruction, edited shapes)`` of one edit of `kind` on a shape named unambiguously, or None when no shape
    of the scene can be named alone."""
    nameable = [k for k, s in enumerate(shapes)
                if sum((o["shape"], o["colour"]) == (s["shape"], s["colour"]) for o in shapes) == 1]
    if not nameable:
        return None
    k = rng.choice(nameable)
    name, edited = name_of(shapes, k), copy.deepcopy(shapes)
    if kind == "remove":
        del edited[k]
        return f"remove {name}", edited
    colour = rng.choice([c for c in COLOURS if c != shapes[k]["colour"]])
    edited[k]["colour"] = colour
    return f"make {name} {colour}", edited


def as_tensor(image) -> torch.Tensor:
    """uint8 `[3, H, W]` of a PIL RGB image."""
    return torch.from_numpy(np.array(image, dtype=np.uint8)).permute(2, 0, 1).contiguous()


class ShapesEdit:
    """Prompt source of the shapes editing task (see the module docstring)."""

    Config = ShapesEditConfig
    disjoint_splits = True  # held-out scene indices are never training ones

    def __init__(self, config: ShapesEditConfig | None = None):
        self.config = config or self.Config()

    def item(self, index: int, kind: str) -> dict | None:
        """The edit item of scene `index` (None when no shape can be named alone)."""
        c = self.config
        shapes = scene(index, c.size, c.max_objects)
        made = edit(shapes, kind, random.Random(f"edit-{index}"))
        if made is None:
            return None
        instruction, edited = made
        source, target = render(shapes, c.size), render(edited, c.size)
        metadata = {"kind": kind, "scene": shapes, "target_scene": edited, "source_image": as_tensor(source),
                    "target_image": as_tensor(target)}
        return {"prompt": instruction, "metadata": metadata, "images": [source]}

    def items(self, start: int, count: int) -> list[dict]:
        out, index = [], start
        while len(out) < count:
            made = self.item(index, self.config.kinds[len(out) % len(self.config.kinds)])
            index += 2  # one parity per split
            if made is not None:
                out.append(made)
        return out

    def train_items(self) -> list[dict]:
        return self.items(2 * self.config.seed * 10**7, self.config.n_train)

    def eval_items(self) -> list[dict]:
        return self.items(2 * self.config.seed * 10**7 + 1, self.config.n_eval)


PLUGIN = ShapesEdit
