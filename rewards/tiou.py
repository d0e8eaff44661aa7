"""Temporal IoU of a temporal-grounding answer: the ``[start, end]`` span (seconds) a video VLM writes for an event,
against the true span.

``tIoU = max(0, min(e, e') - max(s, s')) / (max(e, e') - min(s, s'))`` for a predicted span ``[s, e]`` and a true span
``[s', e']`` (the metric of Charades-STA / ActivityNet-Captions grounding and the reward of Time-R1 and TempSamp-R1).
Two equal zero-length spans score 1.

**Parsing** (inside the last ``<answer>...</answer>`` when there is one, else the whole text): the span is the two
numbers of the block, in any notation that writes exactly two numbers: ``[2.0, 4.5]``, ``(2, 4.5)``, ``2.0 - 4.5``,
``from 2 to 4.5 seconds``, ``2.0s-4.5s``. A dash between two numbers is a separator, never a sign. Parsing is one
regex scan without overlapping quantifiers (linear in the text), after the text is cut to `max_completion_chars`.

**Malformed answers score 0** and are counted (0/1 components, so their means are rates):

- ``no_span``: not exactly two numbers (none, one, three or more; also no text at all);
- ``non_finite``: a number that overflows to infinity (``1e999``);
- ``inverted``: ``end < start``;
- ``several_answers``: more than one ``<answer>`` block (the last is scored, as everywhere in mmgrpo).

A span reaching outside the video (``[0, duration]`` with ``duration`` from the metadata) is clipped to it and counted
in ``clipped``. Samples without a true span (no `gt_key` in their metadata) are not applicable: NaN.

Metadata keys (per sample): `gt_key` (default ``"span"``): ``[start, end]`` in seconds; ``"duration"`` (optional):
the video's length in seconds.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

import torch

from mmgrpo.rewards._common import (
    MAX_COMPLETION_CHARS, check_max_completion_chars, check_tag, cut_texts, fixed_artifacts, fixed_modalities, nans,
    tag_spans, texts,
)
from mmgrpo.types import PromptBatch, RewardResult
from mmgrpo.validation import check_fields, check_text

# unsigned: "2-4" is the span 2 to 4, not the numbers 2 and -4 (`\d+(?:\.\d*)?` keeps the scan linear, see box_iou)
_NUMBER = re.compile(r"(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?")
COMPONENTS = ("tiou", "no_span", "non_finite", "inverted", "clipped", "several_answers")


def parse_span(text: str, answer_tag: str | None = "answer") -> tuple[list[float] | None, dict[str, float]]:
    """The ``[start, end]`` written in `text` (seconds, not clipped) and the 0/1 malformation flags.

    Returns:
        `tuple`: the span (None when malformed) and ``{"no_span", "non_finite", "inverted", "several_answers"}``.
    """
    flags = {"no_span": 0.0, "non_finite": 0.0, "inverted": 0.0, "several_answers": 0.0}
    block = text
    if answer_tag:
        spans = list(tag_spans(text, f"<{answer_tag}>", f"</{answer_tag}>"))
        flags["several_answers"] = float(len(spans) > 1)
        if spans:
            block = text[spans[-1][0]:spans[-1][1]]
    numbers = [float(match) for match in _NUMBER.findall(block)]
    if len(numbers) != 2:
        flags["no_span"] = 1.0
        return None, flags
    if not all(math.isfinite(x) for x in numbers):
        flags["non_finite"] = 1.0
        return None, flags
    if numbers[1] < numbers[0]:
        flags["inverted"] = 1.0
        return None, flags
    return numbers, flags


def temporal_iou(pred: list[float], truth: list[float]) -> float:
    """tIoU of two ``[start, end]`` spans (``start <= end``); two equal zero-length spans give 1, other pairs with a
    zero union give 0."""
    intersection = max(0.0, min(pred[1], truth[1]) - max(pred[0], truth[0]))
    union = max(pred[1], truth[1]) - min(pred[0], truth[0])
    if union <= 0:
        return float(pred == truth)
    return intersection / union


@dataclass
class TIoUConfig:
    """Configuration of [`TIoU`] (see the module docstring for parsing and the counters).

    Args:
        answer_tag (`str`, *optional*, defaults to `"answer"`): read the span inside the last ``<tag>...</tag>`` when
            present (None: the whole text).
        gt_key (`str`, defaults to `"span"`): metadata key of the true ``[start, end]`` (seconds).
        max_completion_chars (`int`, *optional*, defaults to 16384): each text is cut to this many characters before
            parsing (component ``truncated``); 0 or None: no cut (the parser is linear).
    """

    answer_tag: str | None = "answer"
    gt_key: str = "span"
    max_completion_chars: int | None = MAX_COMPLETION_CHARS

    def __post_init__(self):
        check_fields(self)
        check_tag("answer_tag", self.answer_tag)
        check_text("gt_key", self.gt_key)
        check_max_completion_chars(self.max_completion_chars)


class TIoU:
    """Scores ``outputs["texts"]`` (list of `N` strings) against true spans in ``batch.metadata``."""

    Config = TIoUConfig
    modalities = frozenset({"text"})
    group_stage = None  # each score depends on its sample only (see mmgrpo.protocols.RewardFn)
    artifacts = frozenset()  # adds nothing for the sample writers

    modalities_for = classmethod(fixed_modalities)  # see mmgrpo.protocols.RewardFn
    artifacts_for = classmethod(fixed_artifacts)

    def __init__(self, config: TIoUConfig | None = None):
        self.config = config or TIoUConfig()

    def _truth(self, metadata: dict, index: int) -> list[float]:
        truth = metadata[self.config.gt_key]
        ok = isinstance(truth, (list, tuple)) and len(truth) == 2
        values = [float(x) for x in truth] if ok else []
        if not ok or not all(math.isfinite(x) for x in values) or values[1] < values[0]:
            raise ValueError(
                f"tiou: metadata[{self.config.gt_key!r}] of sample {index} must be [start, end] in seconds with "
                f"start <= end, got {truth!r}. Fix the prompt source's ground truth."
            )
        return values

    def score_one(self, text: str | None, metadata: dict, index: int = 0) -> dict[str, float]:
        """Score and components of one answer (see the module docstring)."""
        truth = self._truth(metadata, index)
        result = dict.fromkeys(COMPONENTS, 0.0)
        result["tiou"] = float("nan")
        if text is None:
            result.update(score=0.0, no_span=1.0)
            return result
        span, flags = parse_span(text, self.config.answer_tag)
        result.update(flags)
        if span is None:
            result["score"] = 0.0
            return result
        duration = metadata.get("duration")
        if duration is not None:
            clipped = [min(max(x, 0.0), float(duration)) for x in span]
            result["clipped"] = float(clipped != span)
            span = clipped
        result["tiou"] = result["score"] = temporal_iou(span, truth)
        return result

    def __call__(self, outputs: dict[str, Any], batch: PromptBatch) -> RewardResult:
        """Returns `scores` `[N]` (tIoU, 0 when malformed) and components ``tiou`` (NaN when malformed),
        ``no_span``, ``non_finite``, ``inverted``, ``clipped``, ``several_answers`` and ``truncated``, each `[N]`."""
        n = len(batch)
        answers, truncated = cut_texts(texts(outputs, n, "tiou"), self.config.max_completion_chars)
        columns = {name: nans(n) for name in ("score", *COMPONENTS)}
        for i, (text, metadata) in enumerate(zip(answers, batch.metadata)):
            if self.config.gt_key not in metadata:
                continue
            for name, value in self.score_one(text, metadata, i).items():
                columns[name][i] = value
        scores = columns.pop("score")
        return RewardResult(scores=scores, components={**columns, "truncated": truncated})


PLUGIN = TIoU
