"""StepRVR: 1 when the reasoning is complete (every part of a structured solution is there) and logical (in order).

StepGRPO / R1-VL's step-wise reasoning validity reward, https://arxiv.org/abs/2503.12937: a reasoning path earns 1
when it passes both checks, else 0::

    score = 1[complete] * 1[logical]

- **Completeness**: the text holds the description header, the rationale header, at least `min_steps` step headers
  and the final-answer header (R1-VL's template: ``### Image Description:``, ``### Rationales:``, ``### Step 1:``,
  ``### Step 2:``... and ``### The final answer is:``; each header is an option, ``description_header`` /
  ``rationale_header`` may be empty to drop that part).
- **Logic**: the parts come in the order description -> rationale -> steps -> answer (first description before the
  first rationale before the first step; the last final-answer header after the last step), and the steps are
  numbered ``1, 2, ..., n`` in the order they appear.

A step header is `step_prefix` (``### Step ``), a decimal number, then ``:``. Components ``complete`` and ``logical``
(1 / 0) and ``steps`` (step headers found) are logged. What it does not check: whether any step is correct, or what a
part says (an empty section counts). Never NaN; a text entry that is not a string scores 0 with ``malformed`` = 1.

Linear time: each text is cut to `max_completion_chars` first (component ``truncated``), then found with `str.find` /
`str.rfind` passes and one scan over the step headers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from mmgrpo.rewards._common import MAX_COMPLETION_CHARS, check_max_completion_chars, cut_texts, texts
from mmgrpo.types import PromptBatch, RewardResult
from mmgrpo.validation import check_fields, check_range

MAX_STEP_DIGITS = 6  # a step number longer than this is not a step header


@dataclass
class StepRVRConfig:
    """Configuration of [`StepRVRReward`].

    Args:
        description_header (`str`, defaults to `"### Image Description:"`): opens the description ("" to drop it).
        rationale_header (`str`, defaults to `"### Rationales:"`): opens the rationale ("" to drop it).
        step_prefix (`str`, defaults to `"### Step "`): a step header is this, a number, then ``:``.
        answer_header (`str`, defaults to `"### The final answer is:"`): opens the final answer.
        min_steps (`int`, defaults to 1): fewest steps a complete solution has.
        max_completion_chars (`int`, *optional*, defaults to 16384): each text is cut to this many characters
            first (component ``truncated``); 0 or None: no cut.
    """

    description_header: str = "### Image Description:"
    rationale_header: str = "### Rationales:"
    step_prefix: str = "### Step "
    answer_header: str = "### The final answer is:"
    min_steps: int = 1
    max_completion_chars: int | None = MAX_COMPLETION_CHARS

    def __post_init__(self):
        check_fields(self)
        for key in ("step_prefix", "answer_header"):
            if not getattr(self, key).strip():
                raise ValueError(f"{key} must be a non-empty header, got {getattr(self, key)!r}.")
        check_range("min_steps", self.min_steps, 1, 1024, fix="e.g. 1")
        check_max_completion_chars(self.max_completion_chars)


def step_headers(text: str, prefix: str) -> list[tuple[int, int]]:
    """``(position, number)`` of each step header ``<prefix><digits>:`` of `text`, left to right (linear: one
    `str.find` pass, each header's digits read once)."""
    found, position = [], 0
    while (start := text.find(prefix, position)) >= 0:
        end = start + len(prefix)
        digits = end
        while digits < len(text) and digits - end < MAX_STEP_DIGITS and text[digits].isdecimal():
            digits += 1
        if digits > end and digits < len(text) and text[digits] == ":":
            found.append((start, int(text[end:digits])))
        position = end
    return found


class StepRVRReward:
    """Scores ``outputs["texts"]`` 1 when their reasoning is complete and logically ordered, else 0."""

    Config = StepRVRConfig
    modalities = frozenset({"text"})
    group_stage = None  # each score depends on its sample only (see mmgrpo.protocols.RewardFn)

    def __init__(self, config: StepRVRConfig | None = None):
        self.config = config or StepRVRConfig()

    def check(self, text: str) -> tuple[bool, bool, int]:
        """``(complete, logical, number of step headers)`` of one text."""
        c = self.config
        steps = step_headers(text, c.step_prefix)
        parts = [h for h in (c.description_header, c.rationale_header) if h]
        firsts = [text.find(h) for h in parts]  # [-1 where missing]
        answer = text.rfind(c.answer_header)
        complete = all(p >= 0 for p in firsts) and answer >= 0 and len(steps) >= c.min_steps
        if not complete:
            return False, False, len(steps)
        in_order = all(a < b for a, b in zip(firsts, firsts[1:] + [steps[0][0]]))
        numbered = [number for _, number in steps] == list(range(1, len(steps) + 1))
        logical = in_order and numbered and answer > steps[-1][0]
        return True, logical, len(steps)

    def __call__(self, outputs: dict[str, Any], batch: PromptBatch) -> RewardResult:
        """Returns `scores` `[N]` (1 or 0) and `components` ``complete``, ``logical``, ``steps``, ``malformed`` and
        ``truncated``, each `[N]`."""
        n = len(batch)
        entries, truncated = cut_texts(texts(outputs, n, "step_rvr"), self.config.max_completion_chars)
        rows = [self.check(t) if t is not None else (False, False, 0) for t in entries]
        complete = torch.tensor([float(r[0]) for r in rows], dtype=torch.float32)
        logical = torch.tensor([float(r[1]) for r in rows], dtype=torch.float32)
        return RewardResult(scores=complete * logical, components={
            "complete": complete, "logical": logical,
            "steps": torch.tensor([float(r[2]) for r in rows], dtype=torch.float32),
            "malformed": torch.tensor([float(t is None) for t in entries], dtype=torch.float32),
            "truncated": truncated,
        })


PLUGIN = StepRVRReward
