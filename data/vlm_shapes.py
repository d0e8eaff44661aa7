"""Synthetic visual questions about coloured shapes on a black image: count the shapes of a colour, or name a shape's colour.

Each item is drawn from its index alone (deterministic): 1-4 shapes (circles, squares, triangles), one per quadrant,
no overlap, on a ``size`` x ``size`` image. Questions and answers:

- ``count``: "How many red shapes are there?" -> ``"2"`` (numeric answer); the supervised reasoning names the colour
  in each quadrant in reading order (``"red none blue red"``), then the answer counts the asked colour.
- ``color``: "What colour is the square?" (the shape is unique in the image) -> ``"blue"`` (exact answer).

Items carry ``images`` (one PIL image) and ``metadata`` ``{"task", "answer", "answer_type", "image_size"}``, plus
``"completion"`` with `with_targets`: the supervised target in the R1 layout, ``<think>red none blue red</think>
<answer>2</answer>`` (without the line break), what ``mmgrpo sft`` trains on. Held-out
items use indices disjoint from the training ones. The R1 layout asked of the model is set by `prompt_template`.

With ``ood: true`` (and ``max_objects`` below 4) the source also declares the held-out split ``ood``: scenes with more
shapes than ``max_objects`` (up to 4), which no training or ``eval`` scene has; the counts asked may then exceed any
trained answer.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from PIL import Image, ImageDraw

from mmgrpo.data._held_out import OOD, OOD_OFFSET, SEED_STRIDE, items_by_rule
from mmgrpo.validation import check_fields, check_range, check_seed, check_template

COLOURS = {"red": (230, 25, 25), "green": (25, 230, 25), "blue": (25, 25, 230), "yellow": (230, 230, 25)}
SHAPES = ("circle", "square", "triangle")
TASKS = ("count", "color")
NUMBERS = ("zero", "one", "two", "three", "four")
TEMPLATE = "{question} Answer in <think> </think> and <answer> </answer> tags."


@dataclass
class VLMShapesConfig:
    """Options of [`VLMShapes`].

    Args:
        tasks (`list[str]`): question kinds, from ``count`` and ``color``.
        n_train (`int`), n_eval (`int`): numbers of training and held-out items.
        size (`int`): image side in pixels.
        max_objects (`int`): at most this many shapes per image (1..4).
        prompt_template (`str`): ``{question}`` is replaced by the question.
        seed (`int`): offsets the item indices (another seed, other images).
        with_targets (`bool`): add the target completion (``<think>...</think><answer>...</answer>``) to each item's
            metadata under ``"completion"``, for supervised fine-tuning (``mmgrpo sft``).
        ood (`bool`): also declare the held-out split ``ood`` (`n_eval` scenes with more than `max_objects` shapes);
            needs `max_objects` below 4.
    """

    tasks: list[str] = field(default_factory=lambda: ["count"])
    n_train: int = 2000
    n_eval: int = 200
    size: int = 56
    max_objects: int = 4
    prompt_template: str = TEMPLATE
    seed: int = 0
    with_targets: bool = False
    ood: bool = False

    def __post_init__(self):
        check_fields(self)
        check_seed("seed", self.seed)
        check_range("n_train", self.n_train, 0, 10**5, fix="items are built in memory; training needs some")
        check_range("n_eval", self.n_eval, 0, 10**5, fix="0: no held-out items (then set eval.every=0)")
        check_range("size", self.size, 28, 4096)
        check_template("prompt_template", self.prompt_template, question="q")
        unknown = set(self.tasks) - set(TASKS)
        if unknown or not self.tasks:
            raise ValueError(f"data.tasks must be a non-empty subset of {list(TASKS)}, got {self.tasks}.")
        if not 1 <= self.max_objects <= 4:
            raise ValueError(f"data.max_objects must be in 1..4, got {self.max_objects}.")
        if self.ood and self.max_objects == 4:
            raise ValueError("data.ood: the ood split holds scenes with more shapes than data.max_objects, and a scene "
                             "has at most 4: set data.max_objects below 4 (e.g. 3) or data.ood: false.")
        if self.size < 28:
            raise ValueError(f"data.size must be >= 28 pixels, got {self.size}.")


def scene(index: int, size: int = 56, max_objects: int = 4) -> list[dict]:
    """The shapes of item `index`: ``[{"shape", "colour", "box": [x1, y1, x2, y2], "main": bool}]``, one per
    quadrant (never overlapping). ``k`` shapes (uniform in 1..max_objects) share the *main* colour, the others have
    other colours, so counting answers are uniform over 1..max_objects."""
    rng = random.Random(index)
    main = rng.randint(1, max_objects)
    extra = rng.randint(0, max_objects - main)
    cells = rng.sample(range(4), main + extra)
    colours = list(COLOURS)
    main_colour = colours.pop(rng.randrange(len(colours)))
    cell = size // 2
    shapes = []
    for k, c in enumerate(cells):
        side = rng.randint(cell * 5 // 10, cell * 8 // 10)
        x = (c % 2) * cell + rng.randint(1, cell - side - 1)
        y = (c // 2) * cell + rng.randint(1, cell - side - 1)
        colour = main_colour if k < main else rng.choice(colours)
        shapes.append({"shape": rng.choice(SHAPES), "colour": colour, "box": [x, y, x + side, y + side],
                       "main": k < main, "cell": c})
    return shapes


def render(shapes: list[dict], size: int = 56) -> Image.Image:
    """Draws `shapes` on a black RGB image."""
    image = Image.new("RGB", (size, size), (0, 0, 0))
    draw = ImageDraw.Draw(image)
    for s in shapes:
        x1, y1, x2, y2 = s["box"]
        fill = COLOURS[s["colour"]]
        if s["shape"] == "circle":
            draw.ellipse([x1, y1, x2, y2], fill=fill)
        elif s["shape"] == "square":
            draw.rectangle([x1, y1, x2, y2], fill=fill)
        else:
            draw.polygon([((x1 + x2) / 2, y1), (x2, y2), (x1, y2)], fill=fill)
    return image


def question(index: int, shapes: list[dict], tasks: list[str]) -> dict:
    """The question about `shapes` for item `index`: ``{"task", "question", "answer", "answer_type", "think"}``."""
    rng = random.Random(10_000_019 + index)
    unique = [s for s in shapes if sum(t["shape"] == s["shape"] for t in shapes) == 1]
    task = rng.choice([t for t in tasks if t != "color" or unique] or ["count"])
    if task == "color":
        target = rng.choice(unique)
        return {"task": task, "question": f"What colour is the {target['shape']}?", "answer": target["colour"],
                "answer_type": "exact", "think": f"the {target['shape']} is {target['colour']}"}
    colour = next(s["colour"] for s in shapes if s["main"])
    count = sum(s["colour"] == colour for s in shapes)
    by_cell = {s["cell"]: s["colour"] for s in shapes}
    seen = " ".join(by_cell.get(c, "none") for c in range(4))  # the quadrants in reading order
    return {"task": task, "question": f"How many {colour} shapes are there?", "answer": str(count),
            "answer_type": "numeric", "think": seen}


def target_text(q: dict) -> str:
    """The completion a supervised base model is trained to write."""
    return f"<think>{q['think']}</think><answer>{q['answer']}</answer>"


class VLMShapes:
    """The synthetic shapes questions as a prompt source."""

    Config = VLMShapesConfig
    disjoint_splits = True  # held-out items are drawn from other scene indices than the training items

    def __init__(self, config: VLMShapesConfig):
        self.config = config

    def item(self, index: int, shapes: list[dict] | None = None) -> dict:
        """The item of scene `index` (its `shapes`, when given, instead of the scene of `max_objects` shapes)."""
        c = self.config
        shapes = scene(index, c.size, c.max_objects) if shapes is None else shapes
        q = question(index, shapes, c.tasks)
        metadata = {"task": q["task"], "answer": q["answer"], "answer_type": q["answer_type"],
                    "image_size": [c.size, c.size]}
        if c.with_targets:
            metadata["completion"] = target_text(q)
        return {"prompt": c.prompt_template.format(question=q["question"]), "metadata": metadata,
                "images": [render(shapes, c.size)]}

    def train_items(self) -> list[dict]:
        base = self.config.seed * 1_000_003
        return [self.item(base + i) for i in range(self.config.n_train)]

    def eval_items(self) -> list[dict]:
        base = self.config.seed * 1_000_003 + 500_000  # disjoint from the training indices
        return [self.item(base + i) for i in range(self.config.n_eval)]

    def ood_item(self, index: int) -> dict | None:
        """The ``ood`` item of scene `index`: drawn with up to 4 shapes, None unless it has more than `max_objects`."""
        shapes = scene(index, self.config.size, 4)
        return self.item(index, shapes) if is_ood(shapes, self.config.max_objects) else None

    def eval_splits(self) -> dict[str, list[dict]]:
        """``eval``, and ``ood`` with `ood` (module docstring)."""
        splits = {"eval": self.eval_items()}
        if self.config.ood:
            splits[OOD] = items_by_rule(self.ood_item, self.config.seed * SEED_STRIDE + OOD_OFFSET, self.config.n_eval)
        return splits


def is_ood(shapes: list[dict], max_objects: int) -> bool:
    """The ``ood`` split's rule: a scene with more shapes than the training scenes' `max_objects`."""
    return len(shapes) > max_objects


PLUGIN = VLMShapes
