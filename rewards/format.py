"""Format reward: 1 when the model's text has the required layout (default ``<think>...</think><answer>...</answer>``).

The R1 format reward (DeepSeek-R1, https://arxiv.org/abs/2501.12948), as VLM-R1, R1-V and EasyR1 use it: the whole
text must match `pattern` (Python regex, ``re.DOTALL``, full match), each tag in `unique_tags` must open and close
exactly once (so ``<think>`` cannot be repeated, TRL's ``think_format_reward`` rule), and, when `answer_pattern` is set,
the contents of the last ``<answer>`` block must match it as well (``re.search``), e.g. a JSON box for grounding.

Scores 1 or 0; a text entry that is not a string scores 0 and sets ``malformed`` = 1. Never NaN.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import torch

from mmgrpo.rewards._common import last_tag_block, texts
from mmgrpo.types import PromptBatch, RewardResult

R1_PATTERN = r"\s*<think>.*?</think>\s*<answer>.*?</answer>\s*"


class FormatReward:
    """Scores ``outputs["texts"]`` (list of `N` strings) by their layout."""

    @dataclass
    class Config:
        """Configuration of [`FormatReward`].

        Args:
            pattern (`str`, defaults to the R1 layout): a regex the whole text must match (DOTALL). EasyR1's math
                layout is ``<think>.*</think>.*\\\\boxed\\{.*\\}.*``.
            unique_tags (`list[str]`, defaults to `["think", "answer"]`): tags that must open and close exactly once.
            answer_pattern (`str`, *optional*): a regex the last ``<answer>`` block must contain, e.g.
                ``\\[\\s*\\d+\\s*,\\s*\\d+\\s*,\\s*\\d+\\s*,\\s*\\d+\\s*\\]`` for a box (VLM-R1's REC format).
        """

        pattern: str = R1_PATTERN
        unique_tags: list[str] = field(default_factory=lambda: ["think", "answer"])
        answer_pattern: str | None = None

        def __post_init__(self):
            for key in ("pattern", "answer_pattern"):
                value = getattr(self, key)
                try:
                    re.compile(value or "")
                except re.error as err:
                    raise ValueError(f"format.{key}={value!r} is not a valid regular expression: {err}.") from err

    modalities = frozenset({"text"})

    def __init__(self, config: "FormatReward.Config | None" = None):
        self.config = config or self.Config()
        self.pattern = re.compile(self.config.pattern, re.DOTALL)
        self.answer_pattern = re.compile(self.config.answer_pattern, re.DOTALL) if self.config.answer_pattern else None

    def matches(self, text: str) -> bool:
        """Whether one text has the required layout."""
        if not self.pattern.fullmatch(text):
            return False
        for tag in self.config.unique_tags:
            if text.count(f"<{tag}>") != 1 or text.count(f"</{tag}>") != 1:
                return False
        if self.answer_pattern is not None:
            answer = last_tag_block(text, "answer")
            return answer is not None and self.answer_pattern.search(answer) is not None
        return True

    def __call__(self, outputs: dict[str, Any], batch: PromptBatch) -> RewardResult:
        """Returns `scores` `[N]` (1 or 0) and `components` ``malformed`` `[N]`."""
        answers = texts(outputs, len(batch), "format")
        scores = torch.tensor([float(t is not None and self.matches(t)) for t in answers], dtype=torch.float32)
        malformed = torch.tensor([float(t is None) for t in answers], dtype=torch.float32)
        return RewardResult(scores=scores, components={"malformed": malformed})


PLUGIN = FormatReward
