"""StepRAR: the share of a problem's key reasoning steps that the model's reasoning contains (soft key-step matching).

StepGRPO / R1-VL's step-wise reasoning accuracy reward, https://arxiv.org/abs/2503.12937. Each problem lists its key
steps in ``metadata[key_steps_key]`` (the paper extracts them from a reference solution: the essential intermediate
values, equations and facts). A key step is a string, or a list of equivalent strings (any one of them counts: the
soft matching, e.g. ``["4 red", "four red"]``). With ``K`` key steps of which ``k`` occur in the reasoning::

    score = k / K        in [0, 1]

The paper's reasoning-accuracy reward adds this, weighted by ``alpha`` (R1-VL: 0.1), to the answer's correctness,
``r = 1[answer correct] + alpha * k / K`` (the term is added whether or not the answer is correct); here that is
``composite: {accuracy: {weight: 1}, step_rar: {weight: 0.1}}``, so the answer check stays the `accuracy` reward's.

Matching, by default R1-VL's rule exactly (``scope: "steps"``, ``squeeze_whitespace: false``): the reasoning is the
text of the ``### Step <n>:`` sections only (each from after its header and the white space after it to the next line
starting with ``###`` or the end; the description, rationale and answer sections are not searched), joined with one
space and lower-cased (``str.lower``; spaces and punctuation kept); a key step occurs when one of its alternatives,
lower-cased, is a substring of it. No order, threshold or fuzzy matching. mmgrpo's stricter or looser variants:

- ``scope: "think"``: the reasoning is the last ``<think>...</think>`` block (a text without one scores 0 with
  ``no_reasoning`` = 1); ``scope: "all"``: the whole text.
- ``squeeze_whitespace: true``: case folding and no white space at all on both sides (``x = 5`` matches ``X=5``).

What it does not check: whether a step is used correctly or in order (``"x = 5"`` counts inside ``"x = 5 is wrong"``),
nor the answer. It can be gamed by listing candidates: a reasoning that writes every value it might need contains more
key steps (measured on the tiny temporal-grounding task: the policy wrote five timeline entries instead of four). A
sample without ``metadata[key_steps_key]``, or with an empty list, is not applicable: NaN (R1-VL adds 0 there; in a
sum with the accuracy the total is the same).

Linear time: each text is cut to `max_completion_chars` first (component ``truncated``; R1-VL reads the whole text);
at most `max_key_steps` key steps of at most `max_key_step_chars` characters each are searched (longer metadata is an
error naming the limit), so the work is bounded by a constant times the text's length.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch

from mmgrpo.rewards._common import (
    COMPLETION_CHARS_LIMIT, MAX_COMPLETION_CHARS, check_max_completion_chars, cut_texts, fixed_artifacts,
    fixed_modalities, last_tag_block, nans, texts,
)
from mmgrpo.rewards._step_headers import step_sections
from mmgrpo.types import PromptBatch, RewardResult
from mmgrpo.validation import check_fields, check_range, check_text


@dataclass
class StepRARConfig:
    """Configuration of [`StepRARReward`].

    Args:
        key_steps_key (`str`, defaults to `"key_steps"`): metadata key of the problem's key steps (a list; each entry
            a string or a list of equivalent strings).
        scope (`str`, defaults to `"steps"`): where the steps are looked for: ``"steps"`` (R1-VL: the text of the
            ``### Step <n>:`` sections, joined with a space), ``"think"`` (the last ``<think>`` block) or ``"all"``
            (the whole text).
        squeeze_whitespace (`bool`, defaults to `False`): match after case folding and removing all white space from
            both the reasoning and the key steps (``x = 5`` matches ``X=5``); `False`: R1-VL's ``str.lower`` with the
            spaces kept.
        max_key_steps (`int`, defaults to 64): most key steps a problem may list.
        max_key_step_chars (`int`, defaults to 200): longest key step (or alternative) in characters.
        max_completion_chars (`int`, *optional*, defaults to 16384): each text is cut to this many characters
            first (component ``truncated``); 0 or None: no cut.
    """

    key_steps_key: str = "key_steps"
    scope: Literal["steps", "think", "all"] = "steps"
    squeeze_whitespace: bool = False
    max_key_steps: int = 64
    max_key_step_chars: int = 200
    max_completion_chars: int | None = MAX_COMPLETION_CHARS

    def __post_init__(self):
        check_fields(self)
        check_text("key_steps_key", self.key_steps_key)
        check_range("max_key_steps", self.max_key_steps, 1, 4096, fix="e.g. 64")
        check_range("max_key_step_chars", self.max_key_step_chars, 1, COMPLETION_CHARS_LIMIT, fix="e.g. 200")
        check_max_completion_chars(self.max_completion_chars)


def squeeze(text: str) -> str:
    """Case-folded, without any white space (linear)."""
    return "".join(text.casefold().split())


class StepRARReward:
    """Scores ``outputs["texts"]`` by the share of ``metadata[key_steps_key]`` their reasoning contains."""

    Config = StepRARConfig
    modalities = frozenset({"text"})
    group_stage = None  # each score depends on its sample only (see mmgrpo.protocols.RewardFn)
    artifacts = frozenset()  # adds nothing for the sample writers

    modalities_for = classmethod(fixed_modalities)  # see mmgrpo.protocols.RewardFn
    artifacts_for = classmethod(fixed_artifacts)

    def __init__(self, config: StepRARConfig | None = None):
        self.config = config or StepRARConfig()

    def fold(self, text: str) -> str:
        """`text` as matching compares it: lower-cased (R1-VL), or case-folded without white space (squeezed)."""
        return squeeze(text) if self.config.squeeze_whitespace else text.lower()

    def key_steps(self, value: Any) -> list[list[str]]:
        """The key steps of one problem as lists of folded alternatives ([`fold`]; blank ones left out); a clear error
        for malformed metadata."""
        c, key = self.config, self.config.key_steps_key
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"step_rar: metadata[{key!r}] must be a list of key steps, got {type(value).__name__}.")
        if len(value) > c.max_key_steps:
            raise ValueError(f"step_rar: metadata[{key!r}] lists {len(value)} key steps, more than max_key_steps="
                             f"{c.max_key_steps}; raise the option or shorten the list.")
        steps = []
        for i, step in enumerate(value):
            options = [step] if isinstance(step, str) else step
            if not isinstance(options, (list, tuple)) or not options or not all(isinstance(o, str) for o in options):
                raise ValueError(f"step_rar: metadata[{key!r}][{i}] must be a string or a non-empty list of strings, "
                                 f"got {step!r}.")
            if any(len(o) > c.max_key_step_chars for o in options):
                raise ValueError(f"step_rar: metadata[{key!r}][{i}] has an entry longer than max_key_step_chars="
                                 f"{c.max_key_step_chars}; raise the option or shorten the key step.")
            folded = [self.fold(o) for o in options if o.strip()]
            if not folded:
                raise ValueError(f"step_rar: metadata[{key!r}][{i}] is only white space.")
            steps.append(folded)
        return steps

    def reasoning(self, text: str) -> str | None:
        """The part of `text` searched for key steps (see `scope`), or None when it has none: no step section
        (``"steps"``), no ``<think>`` block (``"think"``)."""
        if self.config.scope == "all":
            return text
        if self.config.scope == "think":
            return last_tag_block(text, "think")
        sections = step_sections(text)
        return " ".join(sections) if sections else None

    def score_one(self, text: str | None, steps: list[list[str]]) -> dict[str, float]:
        if text is None:
            return {"score": 0.0, "matched": 0.0, "no_reasoning": 1.0, "malformed": 1.0}
        reasoning = self.reasoning(text)
        if reasoning is None:
            return {"score": 0.0, "matched": 0.0, "no_reasoning": 1.0, "malformed": 0.0}
        body = self.fold(reasoning)
        matched = sum(any(option in body for option in options) for options in steps)
        return {"score": matched / len(steps), "matched": float(matched), "no_reasoning": 0.0, "malformed": 0.0}

    def __call__(self, outputs: dict[str, Any], batch: PromptBatch) -> RewardResult:
        """Returns `scores` `[N]` in [0, 1] (NaN where not applicable) and `components` ``matched`` (key steps found),
        ``key_steps`` (listed), ``no_reasoning``, ``malformed`` and ``truncated``, each `[N]`."""
        n = len(batch)
        entries, truncated = cut_texts(texts(outputs, n, "step_rar"), self.config.max_completion_chars)
        columns = {name: nans(n) for name in ("score", "matched", "key_steps", "no_reasoning", "malformed")}
        for i, (text, metadata) in enumerate(zip(entries, batch.metadata)):
            value = metadata.get(self.config.key_steps_key)
            if value is None:
                continue
            steps = self.key_steps(value)
            if not steps:
                continue
            columns["key_steps"][i] = float(len(steps))
            for name, result in self.score_one(text, steps).items():
                columns[name][i] = result
        scores = columns.pop("score")
        return RewardResult(scores=scores, components={**columns, "truncated": truncated})


PLUGIN = StepRARReward
