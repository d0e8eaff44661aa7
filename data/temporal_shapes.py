"""Synthetic temporal grounding: short clips of coloured shapes in which each shape slides sideways during its own time
span; the question asks when one of them moves, the answer is ``[start, end]`` in seconds.

A clip has `num_frames` frames at `fps` frames per second (frame ``i`` is the instant ``i / fps``; the clip lasts
``num_frames / fps`` seconds). Each of the ``1 + distractors`` shapes (distinct colour-shape pairs, one horizontal lane
each) stands still, slides by `speed` pixels per frame between frames ``a`` and ``b``, then stands still again: its span
is ``[a / fps, b / fps]``. Span ends are multiples of `frame_step` frames (2 by default: Qwen2-VL merges frame pairs
into one temporal patch, so a finer boundary could not be seen). Items are drawn from their index alone.

Question: "When does the red circle move?" (the target is the only shape of its colour and kind); with ``event:
visible`` each shape is on screen, standing still, only during its span, and the question is "When is the red circle
on screen?". Items carry
``video`` (a list of PIL frames) and ``metadata`` ``{"task": "temporal_grounding", "span": [start, end],
"duration", "fps", "question", "key_steps"}`` (``key_steps``: the entries of the timeline below, what the
`step_rar` reward with ``scope: think`` looks for in a thought), plus ``"completion"`` with `with_targets`: the
supervised target in the R1 layout, what ``mmgrpo sft`` trains on. Its thought is either the target's frames
(``thought: span``), ``<think>frame 2 to 6</think><answer>[1, 3]</answer>``, or a timeline (``thought: timeline``):
for each block of `frame_step` frames (one temporal patch of Qwen2-VL), its start time and the shapes that move within
it, ``<think>0s none. 1s red circle. 2s red circle, blue square. 3s blue square.</think><answer>[1, 3]</answer>``, so
the model states what it sees in each patch before it answers. The `tiou` reward scores answers. Held-out items use
indices disjoint from the training ones and never repeat a training clip.

With ``ood: true`` the source also declares the held-out split ``ood``: the target's span is at a position no shape
of a training or ``eval`` clip ever takes, an interior span (it neither starts at the clip's first frame nor ends at
the last frame a span can end on: with 8 frames at 2 fps, frame step 2, the span [1, 2] s; every start, end and
length still occurs in training); the distractors' spans are not interior.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from PIL import Image

from mmgrpo.data._held_out import OOD, OOD_OFFSET, SEED_STRIDE, items_by_rule
from mmgrpo.data.vlm_shapes import COLOURS, SHAPES, render
from mmgrpo.validation import check_fields, check_range, check_seed, check_template

THOUGHTS = ("span", "timeline")
EVENTS = {"move": "When does the {name} move?", "visible": "When is the {name} on screen?"}
TEMPLATE = "{question} Answer [start, end] in seconds in <think> </think> and <answer> </answer> tags."


@dataclass
class TemporalShapesConfig:
    """Options of [`TemporalShapes`].

    Args:
        n_train (`int`), n_eval (`int`): numbers of training and held-out items.
        size (`int`): frame side in pixels (at least 56: qwen-vl-utils resizes frame lists on a 56-pixel grid).
        num_frames (`int`): frames per clip (a multiple of `frame_step`).
        fps (`float`): frames per second (set the pipeline's ``video_fps`` to the same value).
        frame_step (`int`): span ends fall on multiples of this many frames.
        distractors (`int`): other shapes, each moving during its own span (0-2).
        speed (`int`): pixels a moving shape slides per frame.
        shape_size (`int`): side of a shape in pixels.
        prompt_template (`str`): ``{question}`` is replaced by the question.
        seed (`int`): offsets the item indices (another seed, other clips).
        with_targets (`bool`): add the target completion to each item's metadata under ``"completion"`` (for
            ``mmgrpo sft``).
        thought (`str`): the thought of the target completion, ``"span"`` or ``"timeline"`` (module docstring).
        event (`str`): what happens during a shape's span: ``"move"`` (it slides, and stands still before and after)
            or ``"visible"`` (it is drawn, standing still, only in the frames ``a`` to ``b - 1`` of its span
            ``[a / fps, b / fps]``; the question becomes "When is the red circle on screen?").
        ood (`bool`): keep interior spans out of training and ``eval`` clips and declare the held-out split ``ood``
            (`n_eval` clips whose target has an interior span; module docstring); needs `num_frames` of at least 4
            frame steps.
    """

    n_train: int = 2000
    n_eval: int = 200
    size: int = 56
    num_frames: int = 8
    fps: float = 2.0
    frame_step: int = 2
    distractors: int = 1
    speed: int = 3
    shape_size: int = 10
    prompt_template: str = TEMPLATE
    seed: int = 0
    with_targets: bool = False
    thought: str = "span"
    event: str = "move"
    ood: bool = False

    def __post_init__(self):
        check_fields(self)
        check_seed("seed", self.seed)
        check_range("n_train", self.n_train, 0, 10**5, fix="items are built in memory; training needs some")
        check_range("n_eval", self.n_eval, 0, 10**5, fix="0: no held-out items (then set eval.every=0)")
        check_range("size", self.size, 56, 1024, fix="qwen-vl-utils resizes frame lists on a 56-pixel grid")
        check_range("fps", self.fps, 0.01, 120, fix="frames per second; 2.0 as Qwen-VL's video default")
        check_range("frame_step", self.frame_step, 1, 16, fix="2 matches Qwen2-VL's temporal patch")
        check_range("distractors", self.distractors, 0, 2, fix="each shape needs its own lane")
        check_range("speed", self.speed, 1, 16)
        check_range("num_frames", self.num_frames, 2, 1024, fix="Qwen-VL samples a few frames per second")
        check_template("prompt_template", self.prompt_template, question="q")
        if self.event not in EVENTS:
            raise ValueError(f"data.event must be one of {tuple(EVENTS)}, got {self.event!r}.")
        if self.thought not in THOUGHTS:
            raise ValueError(f"data.thought must be one of {THOUGHTS}, got {self.thought!r}.")
        if self.num_frames < 2 * self.frame_step or self.num_frames % self.frame_step:
            raise ValueError(
                f"data.num_frames must be a multiple of data.frame_step ({self.frame_step}) and hold at least two "
                f"steps, got {self.num_frames}; e.g. num_frames: {4 * self.frame_step}."
            )
        if self.ood and self.num_frames < 4 * self.frame_step:
            raise ValueError(f"data.ood holds out interior spans, which need data.num_frames >= 4 * data.frame_step "
                             f"= {4 * self.frame_step}, got {self.num_frames}: raise num_frames or set ood: false.")
        lanes = 1 + self.distractors
        if self.shape_size * lanes > self.size or self.shape_size < 4:
            raise ValueError(
                f"data.shape_size must be >= 4 and {lanes} lanes of it must fit in data.size ({self.size}), got "
                f"{self.shape_size}."
            )
        if self.shape_size + self.speed * (self.num_frames - self.frame_step) >= self.size:
            raise ValueError(
                f"a shape of data.shape_size={self.shape_size} pixels sliding data.speed={self.speed} pixels per frame "
                f"for up to data.num_frames - data.frame_step = {self.num_frames - self.frame_step} frames leaves a "
                f"{self.size}-pixel frame (data.size); lower data.speed, data.num_frames or data.shape_size, or raise "
                "data.size."
            )


def scene(index: int, config: TemporalShapesConfig) -> list[dict]:
    """The shapes of item `index`, target first: ``{"colour", "shape", "lane", "x0", "direction", "frames": [a, b]}``
    (``x0``: left edge before moving; ``direction``: +1 right, -1 left; the shape moves between frames ``a`` and
    ``b``)."""
    c = config
    rng = random.Random(index)
    pairs = rng.sample([(colour, shape) for colour in COLOURS for shape in SHAPES], 1 + c.distractors)
    lanes = rng.sample(range(1 + c.distractors), 1 + c.distractors)
    ends = list(range(0, c.num_frames, c.frame_step))  # a span starts and ends on these frames
    shapes = []
    for (colour, shape), lane in zip(pairs, lanes):
        a, b = sorted(rng.sample(ends, 2))
        travel = c.speed * (b - a)
        direction = rng.choice((1, -1))
        x0 = rng.randint(0, c.size - c.shape_size - travel - 1)
        if direction < 0:
            x0 += travel
        shapes.append({"colour": colour, "shape": shape, "lane": lane, "x0": x0, "direction": direction,
                       "frames": [a, b]})
    return shapes


def interior(shape: dict, config: TemporalShapesConfig) -> bool:
    """Whether `shape`'s span is interior: it starts after frame 0 and ends before the last frame a span can end on
    (``num_frames - frame_step``): the spans of the ``ood`` split."""
    a, b = shape["frames"]
    return a > 0 and b < config.num_frames - config.frame_step


def in_split(shapes: list[dict], config: TemporalShapesConfig, split: str) -> bool:
    """Whether a clip of `shapes` (target first) belongs to `split` (``"train"``, which ``eval`` clips follow too, or
    ``"ood"``): without ``ood`` every clip trains; with it, training clips have no interior span and ``ood`` clips an
    interior target span among non-interior distractors."""
    if not config.ood:
        return split != OOD
    distractors_fine = not any(interior(s, config) for s in shapes[1:])
    return distractors_fine and interior(shapes[0], config) == (split == OOD)


def signature(shapes: list[dict]) -> tuple:
    """A hashable key equal for two scenes exactly when they render the same clip and ask the same question."""
    return tuple((s["colour"], s["shape"], s["lane"], s["x0"], s["direction"], *s["frames"]) for s in shapes)


def active(shape: dict, frame: int) -> bool:
    """Whether `shape` is in its span at `frame` (``a <= frame < b``): with ``event: move`` it moves from this frame to
    the next, with ``event: visible`` it is on screen."""
    return shape["frames"][0] <= frame < shape["frames"][1]


def x_at(shape: dict, frame: int, speed: int) -> int:
    """Left edge of `shape` at `frame`."""
    a, b = shape["frames"]
    return shape["x0"] + shape["direction"] * speed * (min(max(frame, a), b) - a)


def render_frames(shapes: list[dict], config: TemporalShapesConfig) -> list[Image.Image]:
    """The clip of `shapes`: `num_frames` RGB frames on black."""
    c = config
    lane_height = c.size // (1 + c.distractors)
    frames = []
    for f in range(c.num_frames):
        placed = []
        for s in shapes:
            if c.event == "visible" and not active(s, f):
                continue  # off screen outside its span
            x1 = s["x0"] if c.event == "visible" else x_at(s, f, c.speed)
            y1 = s["lane"] * lane_height + (lane_height - c.shape_size) // 2
            placed.append({**s, "box": [x1, y1, x1 + c.shape_size - 1, y1 + c.shape_size - 1]})
        frames.append(render(placed, c.size))  # the drawing of the vlm_shapes images
    return frames


def timeline_entries(shapes: list[dict], config: TemporalShapesConfig) -> list[str]:
    """For each block of `frame_step` frames, its start time and the shapes moving (``event: visible``: on screen)
    within it (in scene order), e.g.
    ``["0s none.", "1s red circle.", "2s red circle, blue square.", "3s blue square."]``. A shape moving between
    frames ``a`` and ``b`` moves within the blocks that start at frames ``a`` to ``b - frame_step``."""
    c = config
    entries = []
    for start in range(0, c.num_frames, c.frame_step):
        moving = [f"{s['colour']} {s['shape']}" for s in shapes if active(s, start)]
        entries.append(f"{start / c.fps:g}s {', '.join(moving) or 'none'}.")
    return entries


def timeline(shapes: list[dict], config: TemporalShapesConfig) -> str:
    """The timeline thought: the entries of [`timeline_entries`] joined by spaces."""
    return " ".join(timeline_entries(shapes, config))


def target_text(shapes: list[dict], config: TemporalShapesConfig) -> str:
    """The completion a supervised base model is trained to write for a scene (target first)."""
    a, b = shapes[0]["frames"]
    fps = config.fps
    thought = timeline(shapes, config) if config.thought == "timeline" else f"frame {a} to {b}"
    return f"<think>{thought}</think><answer>[{a / fps:g}, {b / fps:g}]</answer>"


class TemporalShapes:
    """The synthetic temporal-grounding clips as a prompt source."""

    Config = TemporalShapesConfig
    disjoint_splits = True  # held-out items are drawn from other indices than the training items

    def __init__(self, config: TemporalShapesConfig):
        self.config = config

    def item(self, index: int, split: str | None = None) -> dict | None:
        """The item of clip `index` (None when `split` is given and the clip is not in it; see [`in_split`])."""
        c = self.config
        if split is not None and not in_split(scene(index, c), c, split):
            return None
        shapes = scene(index, c)
        target = shapes[0]
        a, b = target["frames"]
        question = EVENTS[c.event].format(name=f"{target['colour']} {target['shape']}")
        metadata = {"task": "temporal_grounding", "question": question, "span": [a / c.fps, b / c.fps],
                    "duration": c.num_frames / c.fps, "fps": c.fps, "key_steps": timeline_entries(shapes, c)}
        if c.with_targets:
            metadata["completion"] = target_text(shapes, c)
        return {"prompt": c.prompt_template.format(question=question), "metadata": metadata,
                "video": render_frames(shapes, c)}

    def train_indices(self) -> list[int]:
        """The clip indices of the training items: from ``seed * 1_000_003`` on, those in the training split."""
        c = self.config
        return items_by_rule(lambda i: i if in_split(scene(i, c), c, "train") else None, c.seed * SEED_STRIDE,
                             c.n_train)

    def train_items(self) -> list[dict]:
        return [self.item(index) for index in self.train_indices()]

    def eval_items(self) -> list[dict]:
        """Held-out items: indices disjoint from the training ones, skipping any clip equal to a training clip (the
        space of clips is finite, so a few would repeat)."""
        c = self.config
        train = {signature(scene(index, c)) for index in self.train_indices()}
        items, index = [], c.seed * 1_000_003 + 500_000
        while len(items) < c.n_eval:
            shapes = scene(index, c)
            if signature(shapes) not in train and in_split(shapes, c, "train"):
                items.append(self.item(index))
            index += 1
        return items

    def eval_splits(self) -> dict[str, list[dict]]:
        """``eval``, and ``ood`` with `ood` (module docstring)."""
        splits = {"eval": self.eval_items()}
        if self.config.ood:
            splits[OOD] = items_by_rule(lambda index: self.item(index, OOD), self.config.seed * SEED_STRIDE + OOD_OFFSET,
                                        self.config.n_eval)
        return splits


PLUGIN = TemporalShapes
