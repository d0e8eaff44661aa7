"""Format reward: 1 when the model's text has the required layout (default ``<think>...</think><answer>...</answer>``).

The R1 format reward (DeepSeek-R1, https://arxiv.org/abs/2501.12948), as VLM-R1, R1-V and EasyR1 use it: the whole
text must have the layout `pattern`, each tag in `unique_tags` must open and close exactly once (so ``<think>`` cannot
be repeated, TRL's ``think_format_reward`` rule), and, when `answer_pattern` is set, the contents of the last
``<answer>`` block must match it as well (``re.search``), e.g. a JSON box for grounding.

`pattern` names a built-in layout, checked in one pass of the text (linear time):

- ``"r1"``: ``\\s*<think>.*?</think>\\s*<answer>.*?</answer>\\s*`` (as a full ``re.DOTALL`` match);
- ``"boxed"``: EasyR1's math layout ``<think>.*</think>.*\\\\boxed\\{.*\\}.*``.

These two regexes, written out, name the same layouts. Any other value is a custom Python regex the whole text must
match (``re.DOTALL``, full match). A regex can take quadratic or exponential time on adversarial text, so a custom
`pattern` or an `answer_pattern` needs the length cap `max_completion_chars` (> 0).

Each text is first cut to `max_completion_chars` characters (component ``truncated`` = 1 where it was; the head is
kept, so a cut text loses its closing tag and scores 0). Scores 1 or 0; a text entry that is not a string scores 0
and sets ``malformed`` = 1. Never NaN.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import torch

from mmgrpo.rewards._common import (
    MAX_COMPLETION_CHARS, check_max_completion_chars, check_tag, cut_texts, fixed_artifacts, fixed_modalities,
    last_tag_block, texts,
)
from mmgrpo.types import PromptBatch, RewardResult
from mmgrpo.validation import ConfigError, check_fields, check_text

R1_PATTERN = r"\s*<think>.*?</think>\s*<answer>.*?</answer>\s*"
BOXED_PATTERN = r"<think>.*</think>.*\\boxed\{.*\}.*"
_THINK_THEN_ANSWER = re.compile(r"</think>\s*<answer>")  # one `\s*` between literals: linear


def r1_layout(text: str) -> bool:
    """Whether `text` fully matches `R1_PATTERN`, in linear time: stripped of outer white space it starts with
    ``<think>``, ends with ``</answer>``, and between the two holds ``</think>``, white space, ``<answer>``."""
    body = text.strip()  # str.strip and the regex's \s remove the same (Unicode) white space
    if not (body.startswith("<think>") and body.endswith("</answer>")):
        return False
    return _THINK_THEN_ANSWER.search(body, len("<think>"), len(body) - len("</answer>")) is not None


def boxed_layout(text: str) -> bool:
    """Whether `text` fully matches `BOXED_PATTERN`, in linear time: it starts with ``<think>``, then holds
    ``</think>``, then ``\\boxed{``, then ``}`` (the earliest of each leaves the most room for the rest)."""
    if not text.startswith("<think>"):
        return False
    close = text.find("</think>", len("<think>"))
    boxed = text.find("\\boxed{", close + len("</think>")) if close >= 0 else -1
    return boxed >= 0 and text.find("}", boxed + len("\\boxed{")) >= 0


LAYOUTS = {"r1": r1_layout, "boxed": boxed_layout, R1_PATTERN: r1_layout, BOXED_PATTERN: boxed_layout}


@dataclass
class FormatConfig:
    """Configuration of [`FormatReward`].

    Args:
        pattern (`str`, defaults to `"r1"`): the layout of the whole text: ``"r1"``, ``"boxed"`` (EasyR1's math
            layout) or a custom regex (DOTALL, full match); see the module docstring.
        unique_tags (`list[str]`, defaults to `["think", "answer"]`): tags that must open and close exactly once.
        answer_pattern (`str`, *optional*): a regex the last ``<answer>`` block must contain, e.g.
            ``\\[\\s*\\d+\\s*,\\s*\\d+\\s*,\\s*\\d+\\s*,\\s*\\d+\\s*\\]`` for a box (VLM-R1's REC format).
        max_completion_chars (`int`, *optional*, defaults to 16384): each text is cut to this many characters
            before any check (component ``truncated``); 0 or None: no cut, allowed only without a custom regex.
    """

    pattern: str = "r1"
    unique_tags: list[str] = field(default_factory=lambda: ["think", "answer"])
    answer_pattern: str | None = None
    max_completion_chars: int | None = MAX_COMPLETION_CHARS

    def __post_init__(self):
        check_fields(self)
        for key, value in {"pattern": self.pattern, "answer_pattern": self.answer_pattern}.items():
            check_text(key, value)
            try:
                re.compile(value or "")
            except re.error as err:
                raise ConfigError(f"{key}={value!r} is not a valid regular expression: {err}.") from err
        for i, tag in enumerate(self.unique_tags):
            check_tag(f"unique_tags[{i}]", tag)
        check_max_completion_chars(self.max_completion_chars)
        custom = ["pattern"] if self.pattern not in LAYOUTS else []
        custom += ["answer_pattern"] if self.answer_pattern is not None else []
        if custom and not self.max_completion_chars:
            raise ConfigError(
                f"max_completion_chars={self.max_completion_chars!r} (no cut) with a custom regex in "
                f"{' and '.join(custom)}: a regex can take super-linear time on long adversarial text; set "
                f"max_completion_chars > 0 (default {MAX_COMPLETION_CHARS}), or use pattern 'r1' / 'boxed'."
            )


class FormatReward:
    """Scores ``outputs["texts"]`` (list of `N` strings) by their layout."""

    Config = FormatConfig
    modalities = frozenset({"text"})
    group_stage = None  # each score depends on its sample only (see mmgrpo.protocols.RewardFn)
    artifacts = frozenset()  # adds nothing for the sample writers

    modalities_for = classmethod(fixed_modalities)  # see mmgrpo.protocols.RewardFn
    artifacts_for = classmethod(fixed_artifacts)

    def __init__(self, config: FormatConfig | None = None):
        self.config = config or FormatConfig()
        layout = LAYOUTS.get(self.config.pattern)
        self.layout = layout or re.compile(self.config.pattern, re.DOTALL).fullmatch
        self.answer_pattern = re.compile(self.config.answer_pattern, re.DOTALL) if self.config.answer_pattern else None

    def matches(self, text: str) -> bool:
        """Whether one text has the required layout (tag counts first: they are cheap and bound a custom regex's
        backtracking over repeated tags)."""
        for tag in self.config.unique_tags:
            if text.count(f"<{tag}>") != 1 or text.count(f"</{tag}>") != 1:
                return False
        if not self.layout(text):
            return False
        if self.answer_pattern is not None:
            answer = last_tag_block(text, "answer")
            return answer is not None and self.answer_pattern.search(answer) is not None
        return True

    def __call__(self, outputs: dict[str, Any], batch: PromptBatch) -> RewardResult:
        """Returns `scores` `[N]` (1 or 0) and `components` ``malformed`` and ``truncated``, each `[N]`."""
        answers, truncated = cut_texts(texts(outputs, len(batch), "format"), self.config.max_completion_chars)
        scores = torch.tensor([float(t is not None and self.matches(t)) for t in answers], dtype=torch.float32)
        malformed = torch.tensor([float(t is None) for t in answers], dtype=torch.float32)
        return RewardResult(scores=scores, components={"malformed": malformed, "truncated": truncated})


PLUGIN = FormatReward
