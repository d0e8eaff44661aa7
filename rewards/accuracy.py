"""Answer accuracy: exact match, numeric with tolerance (optionally paying for closeness), multiple choice, or math.

The R1-style accuracy reward (R1-V, VLM-R1, EasyR1; DeepSeek-R1: https://arxiv.org/abs/2501.12948) without a grader
service: the model's answer is the last ``<answer>...</answer>`` block, else the last ``\\boxed{...}``, else the whole
text (component ``tagged`` says which; ``require_tag=True`` scores untagged answers 0). It is compared with
``metadata[answer_key]`` (a string or number, or a list of acceptable ones) by the sample's mode: ``metadata
["answer_type"]`` when present, else the configured `mode`:

- ``"exact"``: equal after normalisation (white space collapsed, surrounding quotes and a final period dropped,
  case-folded unless `case_sensitive`).
- ``"numeric"``: the answer's value (a simple expression such as ``\\frac{84}{2}``, else its last number: ``1,234.5``,
  ``45%``, ``3/4``) within ``atol + rtol * |truth|``; with ``fuzzy_width > 0`` a wrong number still earns
  ``max(0, 1 - e / fuzzy_width)``, ``e = |a - t| / max(|t|, 1)``.
- ``"choice"``: the option letter (``B``, ``(B)``, ``B. text``, ``the answer is B``, or the text of an option listed in
  ``metadata["choices"]``, options in order A, B, C...).
- ``"math"``: equal as simple math (``\\frac{1}{2}`` = ``0.5``, ``2x + x`` = ``3x``, ``x = 5`` = ``5``): a whitelisted
  parse into sympy (see `_math.py`; nothing is eval-ed), exact match first. With ``math_backend: math_verify`` the
  comparison is Hugging Face's `math_verify` instead (an optional extra, ``pip install "mmgrpo[math]"``), which also
  compares intervals (``[1, 2)``), sets (``\\{1, 2\\}`` = ``\\{2, 1\\}``), unordered tuples and inequalities; both
  sides are then capped at 200 characters (its own timeouts rely on signals, which reward-server threads lack).
- ``"auto"``: choice when the sample lists ``choices`` or the truth is one letter, numeric when it is a plain number,
  math when it has digits or LaTeX and parses, else exact.

Scores 1 (correct) or 0; an answer with nothing to compare (no number, no letter, unparseable math, not a string)
scores 0 with ``malformed`` = 1. A sample without ``metadata[answer_key]`` is not applicable: NaN.

Every text is first cut to `max_completion_chars` characters (component ``truncated`` = 1 where it was; the head is
kept, so a cut answer usually loses its tag); all parsing is linear in the length of the text, math answers longer
than 200 characters (after LaTeX rewriting) are not given to sympy.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal

from mmgrpo.rewards import _math
from mmgrpo.rewards._common import (
    MAX_COMPLETION_CHARS, WEIGHT_LIMIT, check_max_completion_chars, check_tag, cut_texts, fixed_artifacts,
    fixed_modalities, last_boxed, last_tag_block, nans, texts,
)
from mmgrpo.types import PromptBatch, RewardResult
from mmgrpo.validation import check_fields, check_range, check_text

MODES = ("auto", "exact", "numeric", "choice", "math")
MATH_VERIFY_MAX_CHARS = 200  # longer math answers are not given to math_verify (bounded work without its timeouts)
# white space, a number, white space, a % and white space, each optional, with no two `\s*` able to share a run
_PLAIN_NUMBER = re.compile(r"\s*(?:(?=[-+\d.eE])[-+]?(\d{1,3}(,\d{3})+|\d+)?(\.\d+)?([eE][-+]?\d+)?\s*)?(?:%\s*)?")
_LETTER_ONLY = re.compile(r"\s*\(?([A-Za-z])\)?[.:)]?\s*")
_LETTER_FIRST = re.compile(r"\s*\(?([A-Z])\)?[.:)]\s")
# one white-space run per gap: two `\s*` around an optional word backtrack quadratically over long white space
_LETTER_SAID = re.compile(r"(?i:answer|option|choice)\s*(?:(?i:is|:)\s*)?\(?([A-Z])\)?(?![A-Za-z])")
_LETTER_PAREN = re.compile(r"\(([A-Z])\)")


def choice_letter(text: str, choices: list[str] | None = None) -> str | None:
    """The option letter an answer names (see the module docstring), or None."""
    for pattern in (_LETTER_ONLY, _LETTER_FIRST):
        match = pattern.fullmatch(text) if pattern is _LETTER_ONLY else pattern.match(text)
        if match:
            return match.group(1).upper()
    said = _LETTER_SAID.findall(text)
    if said:
        return said[-1]
    if choices:
        wanted = _math.normalize_text(text)
        for index, option in enumerate(choices):
            if _math.normalize_text(str(option)) == wanted:
                return chr(ord("A") + index)
    parens = _LETTER_PAREN.findall(text)
    return parens[-1] if parens else None


def verified_equal(answer: str, truth: str) -> float | None:
    """1.0 / 0.0 by `math_verify` (both sides read as LaTeX math), None when the answer has no math in it or is longer
    than ``MATH_VERIFY_MAX_CHARS``."""
    import logging

    from math_verify import parse, verify

    logging.getLogger("math_verify").setLevel(logging.ERROR)  # it warns on every call that its timeouts are off
    if len(answer) > MATH_VERIFY_MAX_CHARS or len(truth) > MATH_VERIFY_MAX_CHARS:
        return None
    got = parse(f"${answer}$", parsing_timeout=None)
    if not got:
        return None
    expected = parse(f"${truth}$", parsing_timeout=None)
    return float(bool(expected) and verify(expected, got, timeout_seconds=None))


@dataclass
class AccuracyConfig:
    """Configuration of [`AccuracyReward`] (see the module docstring for the modes).

    Args:
        mode (`str`, defaults to `"auto"`): ``"auto"``, ``"exact"``, ``"numeric"``, ``"choice"`` or ``"math"``.
        answer_key (`str`, defaults to `"answer"`): metadata key of the ground truth.
        answer_tag (`str`, *optional*, defaults to `"answer"`): the answer is the last ``<tag>...</tag>`` block.
        boxed (`bool`, defaults to `True`): without that tag, take the last ``\\boxed{...}``.
        require_tag (`bool`, defaults to `False`): score 0 (malformed) when neither is found, instead of reading
            the whole text.
        case_sensitive (`bool`, defaults to `False`): exact matching keeps case.
        rtol (`float`, defaults to 1e-4), atol (`float`, defaults to 1e-8): numeric and math tolerance.
        fuzzy_width (`float`, defaults to 0.0): > 0 pays wrong numbers for closeness (relative error at which the
            pay reaches 0).
        max_completion_chars (`int`, *optional*, defaults to 16384): each text is cut to this many characters
            before parsing (component ``truncated``); 0 or None: no cut (the parsers are linear; sympy only ever
            sees short answers).
        math_backend (`str`, defaults to `"builtin"`): ``"builtin"`` (the whitelisted sympy parse, no dependency) or
            ``"math_verify"`` (Hugging Face's `math_verify`, ``pip install "mmgrpo[math]"``) for the math mode.
    """

    mode: Literal["auto", "exact", "numeric", "choice", "math"] = "auto"
    answer_key: str = "answer"
    answer_tag: str | None = "answer"
    boxed: bool = True
    require_tag: bool = False
    case_sensitive: bool = False
    rtol: float = 1e-4
    atol: float = 1e-8
    fuzzy_width: float = 0.0
    max_completion_chars: int | None = MAX_COMPLETION_CHARS
    math_backend: Literal["builtin", "math_verify"] = "builtin"

    def __post_init__(self):
        check_fields(self)  # types; floats finite
        if self.math_backend == "math_verify":
            try:
                import math_verify  # noqa: F401
            except ImportError as err:
                raise ValueError('reward.math_backend: math_verify is not installed: pip install "mmgrpo[math]", '
                                 'or use the builtin backend') from err
        for key, value, high in (("rtol", self.rtol, 1.0), ("atol", self.atol, 1e9),
                                 ("fuzzy_width", self.fuzzy_width, WEIGHT_LIMIT)):
            check_range(key, value, 0, high, fix="give a tolerance >= 0 (0 for exact)")
        check_text("answer_key", self.answer_key)
        check_tag("answer_tag", self.answer_tag)
        check_max_completion_chars(self.max_completion_chars)


class AccuracyReward:
    """Scores ``outputs["texts"]`` (list of `N` strings) against ``batch.metadata[i][answer_key]``."""

    Config = AccuracyConfig
    modalities = frozenset({"text"})
    group_stage = None  # each score depends on its sample only (see mmgrpo.protocols.RewardFn)
    artifacts = frozenset()  # adds nothing for the sample writers

    modalities_for = classmethod(fixed_modalities)  # see mmgrpo.protocols.RewardFn
    artifacts_for = classmethod(fixed_artifacts)

    def __init__(self, config: AccuracyConfig | None = None):
        self.config = config or AccuracyConfig()

    def extract(self, text: str) -> tuple[str, bool]:
        """The answer part of a model text and whether it came from a tag (or ``\\boxed``)."""
        found = last_tag_block(text, self.config.answer_tag) if self.config.answer_tag else None
        if found is None and self.config.boxed:
            found = last_boxed(text)
        return (found.strip(), True) if found is not None else (text.strip(), False)

    @staticmethod
    def resolve_mode(truth: str, metadata: dict, mode: str, math_backend: str = "builtin") -> str:
        mode = metadata.get("answer_type", mode)
        if mode not in MODES:
            raise ValueError(f"accuracy: metadata['answer_type']={mode!r} is not one of {MODES}.")
        if mode != "auto":
            return mode
        if metadata.get("choices") or _LETTER_ONLY.fullmatch(truth):
            return "choice"
        if _PLAIN_NUMBER.fullmatch(truth) and _math.parse_number(truth) is not None:
            return "numeric"
        if re.search(r"[\d\\]", truth) and (math_backend == "math_verify" or _math.parse_math(truth) is not None):
            return "math"
        return "exact"

    def compare(self, answer: str, truth: str, mode: str, metadata: dict) -> float | None:
        """1.0 / 0.0 (or a fuzzy value in between), None when the answer has nothing to compare (malformed)."""
        cfg = self.config
        if mode == "exact":
            return float(_math.normalize_text(answer, cfg.case_sensitive) == _math.normalize_text(truth, cfg.case_sensitive))
        if mode == "choice":
            wanted = choice_letter(truth, metadata.get("choices"))
            got = choice_letter(answer, metadata.get("choices"))
            return None if got is None else float(got == wanted)
        if mode == "numeric":
            target, value = _math.numeric_value(truth), _math.numeric_value(answer)
            if target is None:
                raise ValueError(f"accuracy: numeric mode needs a number as ground truth, got {truth!r}.")
            if value is None:
                return None
            if abs(value - target) <= cfg.atol + cfg.rtol * abs(target):
                return 1.0
            error = abs(value - target) / max(abs(target), 1.0)
            return max(0.0, 1.0 - error / cfg.fuzzy_width) if cfg.fuzzy_width > 0 else 0.0
        if _math.normalize_text(answer) == _math.normalize_text(truth):
            return 1.0
        if cfg.math_backend == "math_verify":
            return verified_equal(answer, truth)
        got = _math.parse_math(answer)  # parsed once: a long answer costs one linear pass
        if got is None:
            return None
        expected = _math.parse_math(truth)
        equal = None if expected is None else _math.expressions_equal(got, expected, rtol=cfg.rtol)
        return 0.0 if equal is None else float(equal)

    def score_one(self, text: str | None, truths: Any, metadata: dict) -> dict[str, float]:
        """Score and components of one answer; `truths` is one ground truth or a list of acceptable ones."""
        if text is None:
            return {"score": 0.0, "malformed": 1.0, "tagged": 0.0}
        answer, tagged = self.extract(text)
        if self.config.require_tag and not tagged:
            return {"score": 0.0, "malformed": 1.0, "tagged": 0.0}
        best, malformed = 0.0, True
        for truth in truths if isinstance(truths, (list, tuple)) else [truths]:
            truth = str(truth)
            mode = self.resolve_mode(truth, metadata, self.config.mode, self.config.math_backend)
            value = self.compare(answer, truth, mode, metadata)
            if value is not None:
                best, malformed = max(best, value), False
        return {"score": best, "malformed": float(malformed), "tagged": float(tagged)}

    def __call__(self, outputs: dict[str, Any], batch: PromptBatch) -> RewardResult:
        """Returns `scores` `[N]` and `components` ``malformed``, ``tagged`` and ``truncated`` (every sample), each
        `[N]`."""
        n = len(batch)
        answers, truncated = cut_texts(texts(outputs, n, "accuracy"), self.config.max_completion_chars)
        columns = {name: nans(n) for name in ("score", "malformed", "tagged")}
        for i, (text, metadata) in enumerate(zip(answers, batch.metadata)):
            if metadata.get(self.config.answer_key) is None:
                continue
            for name, value in self.score_one(text, metadata[self.config.answer_key], metadata).items():
                columns[name][i] = value
        scores = columns.pop("score")
        return RewardResult(scores=scores, components={**columns, "truncated": truncated})


PLUGIN = AccuracyReward
