"""Synthetic image editing on shapes scenes: an input scene, an instruction, and the edited scene as ground truth.

Scenes are those of `vlm_shapes` (1-4 circles, squares and triangles on black, one per quadrant, drawn from the item's
index alone). Each item edits one shape, named so the instruction points at it alone (by its shape when no other
shape of the scene has it, else by colour and shape):

- ``recolor``: "make the red circle blue" (the shape redrawn in another colour of the palette);
- ``remove``: "remove the square" (the shape left out);
- ``move``: "move the triangle left" (the shape shifted by half the image into the empty quadrant beside it: left,
  right, up or down).

Items carry ``images`` (the input scene, one PIL image) and metadata ``kind``, ``word`` (the new colour of a
recolour, the direction of a move, empty for a removal), ``scene`` and ``target_scene`` (the shapes before and after,
JSON-able), and ``source_image`` / ``target_image`` (uint8 tensors `[3, size, size]`), which
`edit_fidelity` compares the edited image with. Training items use even scene indices, held-out items odd ones (disjoint splits).
With ``held_out: unseen`` (the default) the held-out items are moreover edits of combinations never trained on: an
edit's combination is its kind, the edited shape and its colour (the new colour of a recolour), and a quarter of them
(`HELD_OUT`: 3 per kind, each shape and each colour once) are held-out only; every kind, shape and colour alone still
occurs in training. ``held_out: scenes`` holds out scenes only.
"""

from __future__ import annotations

import copy
import random
from dataclasses import dataclass

import numpy as np
import torch

from mmgrpo.data._held_out import held_out_combinations
from mmgrpo.data.vlm_shapes import COLOURS, SHAPES, render, scene
from mmgrpo.validation import check_fields, check_range, check_seed

KINDS = ("recolor", "remove", "move")
DIRECTIONS = {"left": (-1, 0), "right": (1, 0), "up": (0, -1), "down": (0, 1)}  # quadrant steps (column, row)
# (kind, shape, colour) edits held out under `held_out: unseen`: those whose indices in KINDS, SHAPES and COLOURS sum
# to a multiple of 4 (per kind, one colour per shape and one shape per colour; the rule of `seg_shapes`' ood split too)
HELD_OUT = held_out_combinations(KINDS, SHAPES, tuple(COLOURS))


@dataclass
class ShapesEditConfig:
    """Options of [`ShapesEdit`].

    Args:
        seed (`int`, defaults to 0): offset of the scene indices (a different seed gives other scenes).
        n_train (`int`, defaults to 1000): training items.
        n_eval (`int`, defaults to 100): held-out items.
        size (`int`, defaults to 64): image side in pixels (at least 28).
        kinds (`tuple[str, ...]`, defaults to all): edit kinds among ``recolor``, ``remove`` and ``move``, taken in
            turn.
        max_objects (`int`, defaults to 3): most shapes in a scene (1 to 4).
        held_out (`str`, defaults to ``"unseen"``): ``unseen`` holds out the edit combinations of `HELD_OUT` (and the
            scenes of odd indices); ``scenes`` holds out scenes only.
    """

    seed: int = 0
    n_train: int = 1000
    n_eval: int = 100
    size: int = 64
    kinds: tuple[str, ...] = KINDS
    max_objects: int = 3
    held_out: str = "unseen"

    def __post_init__(self):
        check_fields(self)
        check_seed("seed", self.seed)
        check_range("n_train", self.n_train, 0, 10**6, fix="items are built in memory")
        check_range("n_eval", self.n_eval, 0, 10**6, fix="0: no held-out items (then set eval.every=0)")
        check_range("size", self.size, 28, 1024, fix="a scene needs at least 28 pixels")
        check_range("max_objects", self.max_objects, 1, 4, fix="one shape per quadrant")
        if self.held_out not in ("unseen", "scenes"):
            raise ValueError(f"data.held_out must be 'unseen' or 'scenes', got {self.held_out!r}.")
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


def _moved(shape: dict, direction: str, size: int, taken: set[int]) -> dict | None:
    """`shape` moved one quadrant towards `direction` (its box shifted by half the image), or None when that quadrant
    is off the image or taken."""
    dx, dy = DIRECTIONS[direction]
    column, row = shape["cell"] % 2 + dx, shape["cell"] // 2 + dy
    if not (0 <= column < 2 and 0 <= row < 2) or row * 2 + column in taken:
        return None
    half = size // 2
    x1, y1, x2, y2 = shape["box"]
    return {**shape, "cell": row * 2 + column, "box": [x1 + dx * half, y1 + dy * half, x2 + dx * half, y2 + dy * half]}


def candidates(shapes: list[dict], kind: str, size: int) -> list[tuple[int, str, list[dict]]]:
    """Every edit of `kind` on a shape named unambiguously: ``(shape index, instruction word, edited shapes)``, the
    word being the new colour (recolour), the direction (move) or empty (remove)."""
    out = []
    for k, s in enumerate(shapes):
        if sum((o["shape"], o["colour"]) == (s["shape"], s["colour"]) for o in shapes) != 1:
            continue  # no name points at this shape alone
        if kind == "remove":
            out.append((k, "", shapes[:k] + shapes[k + 1:]))
        elif kind == "recolor":
            out += [(k, c, [{**o, "colour": c} if i == k else o for i, o in enumerate(shapes)])
                    for c in COLOURS if c != s["colour"]]
        else:
            taken = {o["cell"] for o in shapes}
            for direction in DIRECTIONS:
                moved = _moved(s, direction, size, taken)
                if moved is not None:
                    out.append((k, direction, [moved if i == k else o for i, o in enumerate(shapes)]))
    return out


def combination(kind: str, shape: dict, word: str) -> tuple[str, str, str]:
    """An edit's ``(kind, shape, colour)``: the new colour for a recolour, the shape's own otherwise."""
    return kind, shape["shape"], word if kind == "recolor" else shape["colour"]


def edit(shapes: list[dict], kind: str, rng: random.Random, size: int,
         allowed=lambda combo: True) -> tuple[int, str, list[dict]] | None:
    """One of the `candidates` of `kind` (drawn by `rng` among those whose combination `allowed` accepts), or None
    when there is none."""
    options = [c for c in candidates(shapes, kind, size) if allowed(combination(kind, shapes[c[0]], c[1]))]
    return rng.choice(options) if options else None


def instruction(kind: str, name: str, word: str) -> str:
    """The instruction of an edit of `kind` on the shape called `name` ("the red circle") with `word` (the new colour
    of a recolour, the direction of a move, empty for a removal)."""
    return {"remove": f"remove {name}", "recolor": f"make {name} {word}", "move": f"move {name} {word}"}[kind]


def as_tensor(image) -> torch.Tensor:
    """uint8 `[3, H, W]` of a PIL RGB image."""
    return torch.from_numpy(np.array(image, dtype=np.uint8)).permute(2, 0, 1).contiguous()


class ShapesEdit:
    """Prompt source of the shapes editing task (see the module docstring)."""

    Config = ShapesEditConfig
    disjoint_splits = True  # held-out scene indices are never training ones

    def __init__(self, config: ShapesEditConfig | None = None):
        self.config = config or self.Config()

    def _allowed(self, index: int):
        """Which edit combinations scene `index`'s split takes (the index's parity; see the module docstring)."""
        held = index % 2 == 1
        if self.config.held_out == "unseen":
            return lambda combo: (combo in HELD_OUT) == held
        return lambda combo: True

    def _as_item(self, shapes: list[dict], kind: str, k: int, word: str, edited: list[dict]) -> dict:
        """The item of one of the `candidates` of `kind` on `shapes`: shape `k` edited with `word`."""
        size, edited = self.config.size, copy.deepcopy(edited)
        source, target = render(shapes, size), render(edited, size)
        metadata = {"kind": kind, "word": word, "scene": shapes, "target_scene": edited,
                    "source_image": as_tensor(source), "target_image": as_tensor(target)}
        return {"prompt": instruction(kind, name_of(shapes, k), word), "metadata": metadata, "images": [source]}

    def _drawn(self, index: int, kind: str) -> tuple[list[dict], tuple[int, str, list[dict]] | None]:
        """Scene `index`'s shapes and the edit of `kind` drawn on it (one of its `candidates`; None when its split
        allows none), before anything is rendered."""
        c = self.config
        shapes = scene(index, c.size, c.max_objects)
        return shapes, edit(shapes, kind, random.Random(f"edit-{index}"), c.size, self._allowed(index))

    def item(self, index: int, kind: str) -> dict | None:
        """The edit item of scene `index` (None when it allows no edit of `kind` in its split: the split is the
        index's parity, and under ``held_out: unseen`` odd indices take `HELD_OUT` combinations only, even ones
        none)."""
        shapes, made = self._drawn(index, kind)
        return None if made is None else self._as_item(shapes, kind, *made)

    def scene_edits(self, index: int) -> list[dict]:
        """Every edit of scene `index` that its split allows, of every kind in `kinds` and on every shape named
        unambiguously, one item each (`item` draws one of them): the same input scene under different instructions,
        with different targets."""
        c = self.config
        shapes, allowed = scene(index, c.size, c.max_objects), self._allowed(index)
        return [self._as_item(shapes, kind, *made) for kind in c.kinds for made in candidates(shapes, kind, c.size)
                if allowed(combination(kind, shapes[made[0]], made[1]))]

    def _scenes(self, start: int, count: int):
        """The first `count` scenes from index `start` on (one parity: one split) that allow an edit of their turn's
        kind (the kinds taken in turn), as ``(index, kind)``."""
        index, found = start, 0
        while found < count:
            kind = self.config.kinds[found % len(self.config.kinds)]
            if self._drawn(index, kind)[1] is not None:
                yield index, kind
                found += 1
            index += 2

    def _split_start(self, held_out: bool) -> int:
        return 2 * self.config.seed * 10**7 + int(held_out)

    def train_items(self) -> list[dict]:
        return [self.item(index, kind) for index, kind in self._scenes(self._split_start(False), self.config.n_train)]

    def eval_items(self) -> list[dict]:
        return [self.item(index, kind) for index, kind in self._scenes(self._split_start(True), self.config.n_eval)]

    def train_scene_edits(self) -> list[dict]:
        """Every edit (`scene_edits`) of the `n_train` scenes `train_items` draws one edit from, in its order."""
        return [e for index, _ in self._scenes(self._split_start(False), self.config.n_train)
                for e in self.scene_edits(index)]

    def eval_splits(self) -> dict[str, list[dict]]:
        return {"eval": self.eval_items()}  # one held-out split


PLUGIN = ShapesEdit
