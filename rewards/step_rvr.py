"""StepRVR: 1 when the reasoning is complete (every part of a structured solution is there) and logical (in order).

StepGRPO / R1-VL's step-wise reasoning validity reward, https://arxiv.org/abs/2503.12937: a reasoning path earns 1
when it passes both checks, else 0::

    score = 1[complete] * 1[logical]

By default R1-VL's rules exactly (case-sensitive; headers as in R1-VL's template, each an option):

- **Completeness**: the text holds ``### Image Description:``, ``### Rationales:``, ``### Step 1:`` (the step prefix
  followed by ``1:``) and ``### The final answer is:``, anywhere, and at least `min_steps` step headers (1 in R1-VL).
- **Logic**: the numbers of the step headers, in the order they appear, are ``1, 2, ..., n``; and the *first*
  final-answer header starts at or after the end of the *last* step header, unless the text (stripped) ends with the
  final-answer header. Where the description and the rationale are is not checked.

mmgrpo's stricter variants: ``part_order: true`` also requires the first description header before the first
rationale header before the first step header; ``answer_check: "last"`` puts the *last* final-answer header after the
start of the last step header instead, with no exemption for a text ending with the header.

A step header is `step_prefix` (``### Step ``), decimal digits, then ``:`` (``01`` reads as 1). Components ``complete``
and ``logical`` (1 / 0) and ``steps`` (step headers found) are logged. What it does not check: whether any step is
correct, or what a part says (an empty section counts). Never NaN; a text entry that is not a string scores 0 with
``malformed`` = 1.

Linear time: each text is cut to `max_completion_chars` first (component ``truncated``; R1-VL reads the whole text),
then found with `str.find` / `str.rfind` passes and one scan over the step headers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch

from mmgrpo.rewards._common import (
    MAX_COMPLETION_CHARS, check_max_completion_chars, cut_texts, fixed_artifacts, fixed_modalities, texts,
)
from mmgrpo.rewards._step_headers import R1_VL_STEP, step_headers
from mmgrpo.types import PromptBatch, RewardResult
from mmgrpo.validation import check_fields, check_range


@dataclass
class StepRVRConfig:
    """Configuration of [`StepRVRReward`].

    Args:
        description_header (`str`, defaults to `"### Image Description:"`): opens the description ("" to drop it).
        rationale_header (`str`, defaults to `"### Rationales:"`): opens the rationale ("" to drop it).
        step_prefix (`str`, defaults to `"### Step "`): a step header is this, a number, then ``:``.
        answer_header (`str`, defaults to `"### The final answer is:"`): opens the final answer.
        min_steps (`int`, defaults to 1): fewest step headers a complete solution has.
        part_order (`bool`, defaults to `False`): also require description before rationale before the first step
            (R1-VL does not check it).
        answer_check (`str`, defaults to `"first"`): ``"first"`` (R1-VL): the first final-answer header starts at or
            after the end of the last step header, unless the text ends with the header; ``"last"``: the last
            final-answer header starts after the last step header starts, no exemption.
        max_completion_chars (`int`, *optional*, defaults to 16384): each text is cut to this many characters
            first (component ``truncated``); 0 or None: no cut.
    """

    description_header: str = "### Image Description:"
    rationale_header: str = "### Rationales:"
    step_prefix: str = R1_VL_STEP
    answer_header: str = "### The final answer is:"
    min_steps: int = 1
    part_order: bool = False
    answer_check: Literal["first", "last"] = "first"
    max_completion_chars: int | None = MAX_COMPLETION_CHARS

    def __post_init__(self):
        check_fields(self)
        for key, value in {"step_prefix": self.step_prefix, "answer_header": self.answer_header}.items():
            if not value.strip():
                raise ValueError(f"{key} must be a non-empty header, got {value!r}.")
        if any(c.isdecimal() for c in self.step_prefix):
            raise ValueError(f"step_prefix must hold no digit (the step number follows it), got {self.step_prefix!r}.")
        check_range("min_steps", self.min_steps, 1, 1024, fix="e.g. 1")
        check_max_completion_chars(self.max_completion_chars)


class StepRVRReward:
    """Scores ``outputs["texts"]`` 1 when their reasoning is complete and logically ordered, else 0."""

    Config = StepRVRConfig
    modalities = frozenset({"text"})
    group_stage = None  # each score depends on its sample only (see mmgrpo.protocols.RewardFn)
    artifacts = frozenset()  # adds nothing for the sample writers

    modalities_for = classmethod(fixed_modalities)  # see mmgrpo.protocols.RewardFn
    artifacts_for = classmethod(fixed_artifacts)

    def __init__(self, config: StepRVRConfig | None = None):
        self.config = config or StepRVRConfig()

    def check(self, text: str) -> tuple[bool, bool, int]:
        """``(complete, logical, number of step headers)`` of one text."""
        c = self.config
        steps = step_headers(text, c.step_prefix)  # [(start, end, number)]
        parts = [h for h in (c.description_header, c.rationale_header) if h]
        firsts = [text.find(h) for h in parts]  # [-1 where missing]
        complete = (all(p >= 0 for p in firsts) and c.answer_header in text and f"{c.step_prefix}1:" in text
                    and len(steps) >= c.min_steps)
        if not complete:
            return False, False, len(steps)
        numbered = [number for _, _, number in steps] == list(range(1, len(steps) + 1))
        if c.answer_check == "first":
            answer_ok = text.strip().endswith(c.answer_header) or text.find(c.answer_header) >= steps[-1][1]
        else:
            answer_ok = text.rfind(c.answer_header) > steps[-1][0]
        in_order = not c.part_order or all(a < b for a, b in zip(firsts, firsts[1:] + [steps[0][0]]))
        return True, numbered and answer_ok and in_order, len(steps)

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
