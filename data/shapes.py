"""Synthetic GenEval-like text-to-image task: flat coloured circles, squares and triangles on a black background.

Prompt kinds follow GenEval: ``single`` ("a red circle"), ``counting`` ("two blue squares"), ``two_objects``
("a red circle and a green triangle", colour attribution) and ``position`` ("a red circle left of a blue square").
Every prompt comes with a JSON-able metadata dictionary that fully describes it, e.g.::

    {"kind": "position", "objects": [{"color": "red", "shape": "circle", "count": 1},
                                     {"color": "blue", "shape": "square", "count": 1}], "relation": "left_of"}

[`render`] draws a correct image for any metadata, and `mmgrpo.rewards.mini_geneval` checks an image from its pixels.
"""

from __future__ import annotations

import copy
import hashlib
import itertools
from dataclasses import dataclass
from typing import Literal

import numpy as np
from PIL import Image, ImageDraw
from mmgrpo.validation import check_fields, check_range, check_seed

# Flat colours at the corners of the RGB cube: every pair (and the background) is >= 200 apart per channel.
PALETTE: dict[str, tuple[int, int, int]] = {
    "red": (230, 25, 25),
    "green": (25, 230, 25),
    "blue": (25, 25, 230),
    "yellow": (230, 230, 25),
    "cyan": (25, 230, 230),
    "magenta": (230, 25, 230),
}
BACKGROUND: tuple[int, int, int] = (0, 0, 0)
SHAPES: tuple[str, ...] = ("circle", "square", "triangle")
KINDS: tuple[str, ...] = ("single", "counting", "two_objects", "position")
RELATIONS: dict[str, str] = {"left_of": "left of", "right_of": "right of", "above": "above", "below": "below"}
NUMBERS: dict[int, str] = {1: "one", 2: "two", 3: "three", 4: "four"}
# every word a prompt can contain (to keep them whole in a small tokenizer)
VOCABULARY: tuple[str, ...] = tuple(
    sorted({"a", "and", "of", *NUMBERS.values(), *PALETTE, *SHAPES, *(s + "s" for s in SHAPES)}
           | {w for r in RELATIONS.values() for w in r.split()})
)


# ----------------------------------------------------------------------------------------------- prompts


def _noun(obj: dict) -> str:
    return obj["shape"] + ("s" if obj["count"] > 1 else "")


def draw_items(pools: dict[str, list[dict]], kinds: tuple[str, ...], n: int, seed: int, prompt_of) -> list[dict]:
    """`n` items ``{"prompt": prompt_of(metadata), "metadata": dict}`` taking the kinds in turn, each kind's pool in a
    seeded random order (reshuffled when used up); shared by the shapes tasks' prompt sources."""
    rng = np.random.default_rng(seed)
    orders = {kind: [] for kind in pools}
    items = []
    for i in range(n):
        kind = kinds[i % len(kinds)]
        if not orders[kind]:
            orders[kind] = list(rng.permutation(len(pools[kind])))
        metadata = pools[kind][orders[kind].pop()]
        items.append({"prompt": prompt_of(metadata), "metadata": copy.deepcopy(metadata)})
    return items


def prompt_from_metadata(metadata: dict) -> str:
    """Writes the prompt of a metadata dictionary (the inverse of the sampling: metadata fixes the prompt)."""
    kind, objs = metadata["kind"], metadata["objects"]
    if kind == "single":
        return f"a {objs[0]['color']} {objs[0]['shape']}"
    if kind == "counting":
        return f"{NUMBERS[objs[0]['count']]} {objs[0]['color']} {_noun(objs[0])}"
    first, second = (f"a {o['color']} {o['shape']}" for o in objs)
    if kind == "two_objects":
        return f"{first} and {second}"
    if kind == "position":
        return f"{first} {RELATIONS[metadata['relation']]} {second}"
    raise ValueError(f"Unknown prompt kind {kind!r}; expected one of {KINDS}.")


def all_metadata(kinds=KINDS, counts=(1, 2, 3)) -> list[dict]:
    """Enumerates the metadata of every distinct prompt of the given kinds, in a fixed order.

    Args:
        kinds (`tuple[str, ...]`): prompt kinds to enumerate.
        counts (`tuple[int, ...]`): object counts used by the ``counting`` kind.
    """
    objects = [{"color": c, "shape": s, "count": 1} for c in PALETTE for s in SHAPES]
    pairs = [(a, b) for a, b in itertools.permutations(objects, 2)]
    out = []
    for kind in kinds:
        if kind == "single":
            out += [{"kind": kind, "objects": [dict(o)]} for o in objects]
        elif kind == "counting":
            out += [{"kind": kind, "objects": [dict(o, count=n)]} for n in counts for o in objects]
        elif kind == "two_objects":
            out += [{"kind": kind, "objects": [dict(a), dict(b)]} for a, b in pairs]
        elif kind == "position":
            out += [{"kind": kind, "objects": [dict(a), dict(b)], "relation": r} for r in RELATIONS for a, b in pairs]
        else:
            raise ValueError(f"Unknown prompt kind {kind!r}; expected one of {KINDS}.")
    return out


def sample_prompt(rng: np.random.Generator, kinds=KINDS, counts=(1, 2, 3)) -> tuple[str, dict]:
    """Samples a prompt uniformly: a kind among `kinds`, then a prompt of that kind.

    Args:
        rng (`np.random.Generator`): source of randomness.
        kinds (`tuple[str, ...]`): prompt kinds to draw from.
        counts (`tuple[int, ...]`): object counts of the ``counting`` kind.

    Returns:
        `tuple[str, dict]`: the prompt and its metadata.
    """
    kind = kinds[rng.integers(len(kinds))]
    pool = all_metadata((kind,), counts)
    metadata = pool[rng.integers(len(pool))]
    return prompt_from_metadata(metadata), metadata


def stable_fraction(text: str) -> float:
    """A number in [0, 1) fixed by `text` across runs and machines (sha256, unlike Python's `hash`)."""
    return int.from_bytes(hashlib.sha256(text.encode("utf-8")).digest()[:8], "big") / 2**64


# ----------------------------------------------------------------------------------------------- rendering


def _object_size_range(n_objects: int, size: int) -> tuple[int, int]:
    """Side lengths (pixels) of the objects: smaller when more objects must fit."""
    lo, hi = {1: (10, 16), 2: (9, 14)}.get(n_objects, (8, 11))
    return max(3, round(lo * size / 32)), max(4, round(hi * size / 32))


def _draw(draw: ImageDraw.ImageDraw, shape: str, x: int, y: int, s: int, color: tuple[int, int, int]) -> None:
    """Draws `shape` with bounding box [x, x + s) x [y, y + s), hard edges (no anti-aliasing)."""
    if shape == "square":
        draw.rectangle([x, y, x + s - 1, y + s - 1], fill=color)
    elif shape == "circle":
        draw.ellipse([x, y, x + s - 1, y + s - 1], fill=color)
    elif shape == "triangle":  # isosceles, pointing up, base = height
        draw.polygon([(x + (s - 1) / 2, y), (x, y + s - 1), (x + s - 1, y + s - 1)], fill=color)
    else:
        raise ValueError(f"Unknown shape {shape!r}; expected one of {SHAPES}.")


def _separated(box, boxes, gap: int) -> bool:
    x, y, s = box
    return all(
        x + s + gap <= bx or bx + bs + gap <= x or y + s + gap <= by or by + bs + gap <= y for bx, by, bs in boxes
    )


def shape_centroid(shape: str, x: float, y: float, s: float) -> tuple[float, float]:
    """Centroid (pixels) of `shape` drawn with bounding box [x, x + s) x [y, y + s) (a triangle's is low)."""
    return x + (s - 1) / 2, y + (2 * (s - 1) / 3 if shape == "triangle" else (s - 1) / 2)


def _relation_holds(a, b, relation: str, min_offset: float) -> bool:
    """Whether object `a` = (shape, (x, y, s)) is `relation` of `b`, along a dominant axis, comparing centroids."""
    (ax, ay), (bx, by) = shape_centroid(a[0], *a[1]), shape_centroid(b[0], *b[1])
    dx, dy = ax - bx, ay - by
    main, other = {"left_of": (-dx, dy), "right_of": (dx, dy), "above": (-dy, dx), "below": (dy, dx)}[relation]
    return main >= min_offset and main >= 1.5 * abs(other)


def render(metadata: dict, rng: np.random.Generator, size: int = 32) -> Image.Image:
    """Draws a correct image for a prompt: the right objects, counts and relation, nothing else.

    Objects get random sizes and positions; they never overlap and are at least 2 pixels apart. For ``position``,
    the first object is clearly on the stated side of the second (the offset along that axis is at least 1.5x the
    offset across it).

    Args:
        metadata (`dict`): prompt metadata (see the module docstring).
        rng (`np.random.Generator`): source of randomness.
        size (`int`, defaults to 32): image side in pixels (at least 24).

    Returns:
        `PIL.Image.Image`: an RGB image of `size` x `size`.
    """
    if size < 24:
        raise ValueError(f"`size` must be at least 24 pixels to fit three objects, got {size}.")
    specs = [(o["color"], o["shape"]) for o in metadata["objects"] for _ in range(o["count"])]
    lo, hi = _object_size_range(len(specs), size)
    gap = max(2, size // 16)
    for attempt in range(1000):
        shrink = attempt // 200  # give up on the largest sizes if placement keeps failing
        boxes = []
        for _ in specs:
            s = int(rng.integers(lo, max(lo, hi - shrink) + 1))
            for _ in range(50):
                box = (int(rng.integers(0, size - s + 1)), int(rng.integers(0, size - s + 1)), s)
                if _separated(box, boxes, gap):
                    boxes.append(box)
                    break
        if len(boxes) < len(specs):
            continue
        if metadata["kind"] == "position" and not _relation_holds(
            (specs[0][1], boxes[0]), (specs[1][1], boxes[1]), metadata["relation"], size / 8
        ):
            continue
        break
    else:  # pragma: no cover - placement succeeds within a few attempts for the sizes above
        raise RuntimeError(f"Could not place the objects of {metadata}.")
    image = Image.new("RGB", (size, size), BACKGROUND)
    draw = ImageDraw.Draw(image)
    for (color, shape), (x, y, s) in zip(specs, boxes):
        _draw(draw, shape, x, y, s, PALETTE[color])
    return image


# ----------------------------------------------------------------------------------------------- plugin


@dataclass
class ShapesPromptsConfig:
    """Options of [`ShapesPrompts`].

    Args:
        seed (`int`, defaults to 0): seed of the item draws.
        n_train (`int`, defaults to 1000): number of train items (prompts repeat only once a kind's pool is spent).
        n_eval (`int`, defaults to 200): number of held-out items.
        kinds (`tuple[str, ...]`, defaults to all four kinds): prompt kinds, among ``single``, ``counting``,
            ``two_objects``, ``position``.
        counts (`tuple[int, ...]`, defaults to `(1, 2, 3)`): object counts of ``counting`` prompts (1 to 4).
        eval_fraction (`float`, defaults to 0.2): share of the distinct prompts held out for eval.
        held_out (`str`, defaults to `"unseen"`): ``"unseen"`` (held-out prompts new to base training and RL) or
            ``"rl_only"`` (held-out prompts the base model was trained on but RL never sees); see the class doc.
        image_size (`int`, defaults to 32): side of the rendered images, in pixels.
        train_kinds (`tuple[str, ...]`, *optional*): the kinds training draws from, a subset of `kinds` (default:
            all of `kinds`). Held-out items always cover every kind of `kinds`, so training can skip a kind the
            model already gets right and still be measured on it.
    """

    seed: int = 0
    n_train: int = 1000
    n_eval: int = 200
    kinds: tuple[str, ...] = KINDS
    counts: tuple[int, ...] = (1, 2, 3)
    eval_fraction: float = 0.2
    held_out: Literal["unseen", "rl_only"] = "unseen"
    image_size: int = 32
    train_kinds: tuple[str, ...] | None = None

    def __post_init__(self):
        check_fields(self)
        check_seed("seed", self.seed)
        check_range("n_train", self.n_train, 0, 10**6, fix="items are built in memory; training needs some")
        check_range("n_eval", self.n_eval, 0, 10**6, fix="0: no held-out items (then set eval.every=0)")
        self.kinds = tuple(self.kinds)
        self.counts = tuple(self.counts)
        unknown = [k for k in self.kinds if k not in KINDS]
        if not self.kinds or unknown:
            raise ValueError(f"data.kinds has unknown or no kinds {unknown}; choose from {KINDS}.")
        self.train_kinds = tuple(self.train_kinds) if self.train_kinds is not None else self.kinds
        outside = [k for k in self.train_kinds if k not in self.kinds]
        if not self.train_kinds or outside:
            raise ValueError(
                f"data.train_kinds {list(self.train_kinds)} must be a non-empty subset of kinds "
                f"{list(self.kinds)}: add {outside} to kinds or remove them from train_kinds."
            )
        bad = [n for n in self.counts if n not in NUMBERS]
        if not self.counts or bad:
            raise ValueError(f"data.counts {self.counts} must be non-empty values in 1..4.")
        if self.held_out not in ("unseen", "rl_only"):
            raise ValueError(f"data.held_out must be 'unseen' or 'rl_only', got {self.held_out!r}.")
        if not 0.0 < self.eval_fraction < (0.5 if self.held_out == "rl_only" else 1.0):
            raise ValueError(
                f"data.eval_fraction must be in (0, 1) (below 0.5 with held_out=rl_only), got "
                f"{self.eval_fraction}; 0.2 is usual."
            )
        if self.n_train < 0 or self.n_eval < 0:
            raise ValueError(f"n_train ({self.n_train}) and n_eval ({self.n_eval}) must be >= 0.")
        check_range("image_size", self.image_size, 24, 1024, fix="three objects need at least 24 pixels")


class ShapesPrompts:
    """Prompt source of the shapes task, with disjoint train and held-out (eval) prompt strings.

    Every distinct prompt has a fixed ``stable_fraction(prompt)`` in [0, 1). With ``held_out="unseen"`` the prompts
    below `eval_fraction` are held out (the shipped base model was trained on the others, so these are combinations
    neither base training nor RL ever saw: zero-shot composition), and RL trains on the rest. With
    ``held_out="rl_only"`` the held-out prompts are those in ``[eval_fraction, 2 * eval_fraction)``: the base model
    saw them, RL never does (RL trains on ``>= 2 * eval_fraction``), which is GenEval's situation for a pretrained
    model (its test prompts are new to RL, not to pretraining). Items are drawn kind by kind in turn (so kinds are
    balanced), without repeating a prompt until its kind's pool is used up. Everything is fixed by `seed`.
    """

    Config = ShapesPromptsConfig
    disjoint_splits = True  # held-out prompt strings are never training prompts

    def __init__(self, config: ShapesPromptsConfig | None = None):
        self.config = config or self.Config()
        self.train_pools: dict[str, list[dict]] = {}
        self.eval_pools: dict[str, list[dict]] = {}
        for kind in self.config.kinds:
            pool = all_metadata((kind,), self.config.counts)
            fractions = [stable_fraction(prompt_from_metadata(m)) for m in pool]
            f = self.config.eval_fraction
            lo, hi = (0.0, f) if self.config.held_out == "unseen" else (f, 2 * f)
            self.train_pools[kind] = [m for m, x in zip(pool, fractions) if x >= hi]
            self.eval_pools[kind] = [m for m, x in zip(pool, fractions) if lo <= x < hi]
            if not self.train_pools[kind] or not self.eval_pools[kind]:
                raise ValueError(f"Kind {kind!r} has an empty train or eval split; change eval_fraction.")

    def train_items(self) -> list[dict]:
        """`n_train` items ``{"prompt": str, "metadata": dict}`` from the train prompts of `train_kinds`."""
        return draw_items(self.train_pools, self.config.train_kinds, self.config.n_train, self.config.seed,
                          prompt_from_metadata)

    def eval_items(self) -> list[dict]:
        """`n_eval` items ``{"prompt": str, "metadata": dict}`` from the held-out prompts."""
        return draw_items(self.eval_pools, self.config.kinds, self.config.n_eval, self.config.seed + 1,
                          prompt_from_metadata)

    def eval_splits(self) -> dict[str, list[dict]]:
        return {"eval": self.eval_items()}  # one held-out split

    def render(self, metadata: dict, rng: np.random.Generator) -> Image.Image:
        """A correct image for `metadata` at the configured size (see [`render`])."""
        return render(metadata, rng, self.config.image_size)


PLUGIN = ShapesPrompts
