"""Synthetic text-to-video task: flat coloured shapes on a black background that move or change size.

Prompts name a colour, a shape, a count and a motion: ``"a red circle moving right"``, ``"two blue squares moving
down"``, ``"a green triangle growing"``, ``"three cyan squares shrinking"``. Kinds are ``single`` (one object) and
``counting`` (two or three objects of the same colour and shape, all moving alike). Every prompt comes with a
JSON-able metadata dictionary that fully describes it, e.g.::

    {"kind": "counting", "objects": [{"color": "blue", "shape": "square", "count": 2}], "motion": "down"}

Colours, shapes and the drawing of one shape come from [`mmgrpo.data.shapes`]. [`render_clip`] draws a correct clip
`[F, 3, H, W]` in [0, 1] for any metadata, and `mmgrpo.rewards.moving_shapes` checks a clip from its pixels.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
from PIL import Image, ImageDraw

from mmgrpo.data.shapes import BACKGROUND, NUMBERS, PALETTE, SHAPES, _draw, _separated, draw_items, stable_fraction
from mmgrpo.validation import check_fields, check_range, check_seed

KINDS: tuple[str, ...] = ("single", "counting")
# motion -> the words of the prompt; translations move the objects rigidly, the others scale them about their centres
MOTIONS: dict[str, str] = {
    "right": "moving right",
    "left": "moving left",
    "up": "moving up",
    "down": "moving down",
    "growing": "growing",
    "shrinking": "shrinking",
}
TRANSLATIONS: dict[str, tuple[int, int]] = {"right": (1, 0), "left": (-1, 0), "up": (0, -1), "down": (0, 1)}
# every word a prompt can contain (to keep them whole in a small tokenizer)
VOCABULARY: tuple[str, ...] = tuple(
    sorted({"a", *NUMBERS.values(), *PALETTE, *SHAPES, *(s + "s" for s in SHAPES)}
           | {w for m in MOTIONS.values() for w in m.split()})
)


# ----------------------------------------------------------------------------------------------- prompts


def prompt_from_metadata(metadata: dict) -> str:
    """Writes the prompt of a metadata dictionary (metadata fixes the prompt)."""
    obj = metadata["objects"][0]
    motion = MOTIONS[metadata["motion"]]
    if obj["count"] == 1:
        return f"a {obj['color']} {obj['shape']} {motion}"
    return f"{NUMBERS[obj['count']]} {obj['color']} {obj['shape']}s {motion}"


def all_metadata(kinds=KINDS, counts=(2, 3), motions=tuple(MOTIONS)) -> list[dict]:
    """Enumerates the metadata of every distinct prompt of the given kinds, in a fixed order.

    Args:
        kinds (`tuple[str, ...]`): prompt kinds (``single``, ``counting``).
        counts (`tuple[int, ...]`): object counts of the ``counting`` kind.
        motions (`tuple[str, ...]`): motions (keys of `MOTIONS`).
    """
    out = []
    for kind in kinds:
        if kind not in KINDS:
            raise ValueError(f"Unknown prompt kind {kind!r}; expected one of {KINDS}.")
        for n in ((1,) if kind == "single" else counts):
            for color, shape, motion in itertools.product(PALETTE, SHAPES, motions):
                out.append({"kind": kind, "objects": [{"color": color, "shape": shape, "count": n}], "motion": motion})
    return out


# ----------------------------------------------------------------------------------------------- rendering


def _sizes(n_objects: int, motion: str, size: int) -> tuple[int, int, int, int]:
    """Object side ranges (pixels, at `size`): ``(lo, hi)`` of translated objects, or of the small and the large end
    of a scaling one, as ``(small_lo, small_hi, large_lo, large_hi)``."""
    scale = size / 32
    if motion in TRANSLATIONS:
        lo, hi = {1: (8, 12), 2: (7, 10)}.get(n_objects, (7, 9))
        return round(lo * scale), round(hi * scale), 0, 0
    small, large = {1: ((7, 8), (12, 14)), 2: ((6, 7), (11, 12))}.get(n_objects, ((6, 6), (10, 11)))
    return tuple(round(v * scale) for v in (*small, *large))


def _place(n: int, side: int, size: int, bounds: tuple[int, int, int, int], gap: int, rng) -> list | None:
    """`n` separated boxes ``(x, y, side)`` with ``x`` in [x0, x1] and ``y`` in [y0, y1], or None."""
    x0, x1, y0, y1 = bounds
    boxes = []
    for _ in range(n):
        for _ in range(50):
            box = (int(rng.integers(x0, x1 + 1)), int(rng.integers(y0, y1 + 1)), side)
            if _separated(box, boxes, gap):
                boxes.append(box)
                break
        else:
            return None
    return boxes


def clip_boxes(metadata: dict, rng: np.random.Generator, size: int = 32, num_frames: int = 5) -> list[list[tuple]]:
    """Bounding boxes of a correct clip: per frame, one ``(x, y, side)`` per object (pixels).

    Translations move every object by the same total displacement (a quarter to a third of the side, split evenly
    over the frames) and stay inside the frame; growing objects go from 6-8 to 10-14 pixels at 32 x 32 (shrinking
    ones the reverse) about a fixed centre. Objects never overlap and are at least ``size // 16`` pixels apart.
    """
    obj, motion = metadata["objects"][0], metadata["motion"]
    n, gap = obj["count"], max(2, size // 16)
    lo, hi, big_lo, big_hi = _sizes(n, motion, size)
    steps = [f / (num_frames - 1) for f in range(num_frames)]
    for _ in range(1000):
        if motion in TRANSLATIONS:
            side = int(rng.integers(lo, hi + 1))
            travel = int(rng.integers(round(size / 4), round(size / 3) + 1))
            dx, dy = TRANSLATIONS[motion]
            free = size - side
            x0, y0 = max(0, -dx * travel), max(0, -dy * travel)
            start = _place(n, side, size, (x0, free - max(0, dx * travel), y0, free - max(0, dy * travel)), gap, rng)
            if start is None:
                continue
            return [[(x + round(dx * travel * t), y + round(dy * travel * t), side) for x, y, _ in start]
                    for t in steps]
        if motion not in ("growing", "shrinking"):
            raise ValueError(f"Unknown motion {motion!r}; expected one of {tuple(MOTIONS)}.")
        small, large = int(rng.integers(lo, hi + 1)), int(rng.integers(big_lo, big_hi + 1))
        boxes = _place(n, large, size, (0, size - large, 0, size - large), gap, rng)
        if boxes is None:
            continue
        sides = [round(small + (large - small) * t) for t in steps]
        if motion == "shrinking":
            sides = sides[::-1]
        return [[(x + (large - s) // 2, y + (large - s) // 2, s) for x, y, _ in boxes] for s in sides]
    raise RuntimeError(f"Could not place the objects of {metadata}.")  # pragma: no cover


def render_clip(metadata: dict, rng: np.random.Generator, size: int = 32, num_frames: int = 5) -> torch.Tensor:
    """Draws a correct clip for a prompt: the right objects and motion in every frame, nothing else.

    Args:
        metadata (`dict`): prompt metadata (see the module docstring).
        rng (`np.random.Generator`): source of randomness (sizes, positions, travel).
        size (`int`, defaults to 32): frame side in pixels (at least 24).
        num_frames (`int`, defaults to 5): frames (at least 2).

    Returns:
        `torch.FloatTensor` of shape `[F, 3, H, W]`: values in [0, 1].
    """
    if size < 24:
        raise ValueError(f"`size` must be at least 24 pixels to fit three moving objects, got {size}.")
    if num_frames < 2:
        raise ValueError(f"`num_frames` must be at least 2 to show motion, got {num_frames}.")
    obj = metadata["objects"][0]
    color = PALETTE[obj["color"]]
    frames = []
    for boxes in clip_boxes(metadata, rng, size, num_frames):
        image = Image.new("RGB", (size, size), BACKGROUND)
        draw = ImageDraw.Draw(image)
        for x, y, s in boxes:
            _draw(draw, obj["shape"], x, y, s, color)
        frames.append(np.asarray(image))
    clip = torch.from_numpy(np.stack(frames)).permute(0, 3, 1, 2)  # [F, 3, H, W] uint8
    return clip.float() / 255.0


# ----------------------------------------------------------------------------------------------- plugin


@dataclass
class MovingShapesConfig:
    """Configuration of [`MovingShapesPrompts`].

    Args:
        seed (`int`, defaults to 0): seed of the item draws.
        n_train (`int`, defaults to 1000): number of train items (prompts repeat only once a kind's pool is spent).
        n_eval (`int`, defaults to 200): number of held-out items.
        kinds (`tuple[str, ...]`, defaults to `("single", "counting")`): prompt kinds.
        counts (`tuple[int, ...]`, defaults to `(2, 3)`): object counts of ``counting`` prompts (2 to 3).
        motions (`tuple[str, ...]`, defaults to all six): motions, among ``right``, ``left``, ``up``, ``down``,
            ``growing``, ``shrinking``.
        eval_fraction (`float`, defaults to 0.2): share of the distinct prompts held out for eval.
        held_out (`str`, defaults to `"unseen"`): ``"unseen"`` (held-out prompts new to base training and RL) or
            ``"rl_only"`` (prompts the base model was trained on but RL never sees), as in `ShapesPrompts`.
        image_size (`int`, defaults to 32): side of the rendered frames, in pixels.
        num_frames (`int`, defaults to 5): frames of the rendered clips.
    """

    seed: int = 0
    n_train: int = 1000
    n_eval: int = 200
    kinds: tuple[str, ...] = KINDS
    counts: tuple[int, ...] = (2, 3)
    motions: tuple[str, ...] = tuple(MOTIONS)
    eval_fraction: float = 0.2
    held_out: Literal["unseen", "rl_only"] = "unseen"
    image_size: int = 32
    num_frames: int = 5

    def __post_init__(self):
        check_fields(self)
        check_seed("seed", self.seed)
        check_range("n_train", self.n_train, 0, 10**6, fix="items are built in memory; training needs some")
        check_range("n_eval", self.n_eval, 0, 10**6, fix="0: no held-out items (then set eval.every=0)")
        self.kinds, self.counts, self.motions = tuple(self.kinds), tuple(self.counts), tuple(self.motions)
        for key, values, allowed in (("kinds", self.kinds, KINDS), ("counts", self.counts, (2, 3)),
                                     ("motions", self.motions, tuple(MOTIONS))):
            bad = [v for v in values if v not in allowed]
            if not values or bad or len(set(values)) != len(values):
                raise ValueError(
                    f"MovingShapesConfig.{key} {list(values)} must be distinct values among {list(allowed)} "
                    f"(not {bad})."
                )
        if self.held_out not in ("unseen", "rl_only"):
            raise ValueError(f"MovingShapesConfig.held_out must be 'unseen' or 'rl_only', got {self.held_out!r}.")
        if not 0.0 < self.eval_fraction < (0.5 if self.held_out == "rl_only" else 1.0):
            raise ValueError(
                f"MovingShapesConfig.eval_fraction must be in (0, 1) (below 0.5 with held_out=rl_only), got "
                f"{self.eval_fraction}; 0.2 is usual."
            )
        check_range("image_size", self.image_size, 24, 1024, fix="three moving objects need at least 24 pixels")
        check_range("num_frames", self.num_frames, 2, 1024, fix="motion needs at least 2 frames")


class MovingShapesPrompts:
    """Prompt source of the moving-shapes task, with disjoint train and held-out prompt strings.

    As in `ShapesPrompts`: every distinct prompt has a fixed ``stable_fraction(prompt)`` in [0, 1); with
    ``held_out="unseen"`` those below `eval_fraction` are held out (colour / shape / count / motion combinations that
    neither the shipped base model nor RL saw), with ``held_out="rl_only"`` those in ``[eval_fraction,
    2 * eval_fraction)``. Items are drawn kind by kind in turn, without repeating a prompt until its kind's pool is
    used up. Everything is fixed by `seed`.
    """

    Config = MovingShapesConfig
    disjoint_splits = True  # held-out prompt strings are never training prompts

    def __init__(self, config: MovingShapesConfig | None = None):
        self.config = config or MovingShapesConfig()
        self.train_pools: dict[str, list[dict]] = {}
        self.eval_pools: dict[str, list[dict]] = {}
        f = self.config.eval_fraction
        lo, hi = (0.0, f) if self.config.held_out == "unseen" else (f, 2 * f)
        for kind in self.config.kinds:
            pool = all_metadata((kind,), self.config.counts, self.config.motions)
            fractions = [stable_fraction(prompt_from_metadata(m)) for m in pool]
            self.train_pools[kind] = [m for m, x in zip(pool, fractions) if x >= hi]
            self.eval_pools[kind] = [m for m, x in zip(pool, fractions) if lo <= x < hi]
            if not self.train_pools[kind] or not self.eval_pools[kind]:
                raise ValueError(f"Kind {kind!r} has an empty train or eval split; change eval_fraction or motions.")

    def train_items(self) -> list[dict]:
        """`n_train` items ``{"prompt": str, "metadata": dict}`` from the train prompts."""
        return draw_items(self.train_pools, tuple(self.train_pools), self.config.n_train, self.config.seed,
                          prompt_from_metadata)

    def eval_items(self) -> list[dict]:
        """`n_eval` items ``{"prompt": str, "metadata": dict}`` from the held-out prompts."""
        return draw_items(self.eval_pools, tuple(self.eval_pools), self.config.n_eval, self.config.seed + 1,
                          prompt_from_metadata)

    def eval_splits(self) -> dict[str, list[dict]]:
        return {"eval": self.eval_items()}  # one held-out split

    def render(self, metadata: dict, rng: np.random.Generator) -> torch.Tensor:
        """A correct clip `[F, 3, H, W]` in [0, 1] for `metadata` at the configured size (see [`render_clip`])."""
        return render_clip(metadata, rng, self.config.image_size, self.config.num_frames)


PLUGIN = MovingShapesPrompts
