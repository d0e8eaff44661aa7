"""Text rewards under adversarial completions: 1 MB inputs finish with the length cap off (the parsers are linear), the
cap cuts and counts, and property-based checks (hypothesis, derandomized) of the parsers."""

import json
import re
import signal
import time
from contextlib import contextmanager

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mmgrpo import registry
from mmgrpo.rewards._common import MAX_COMPLETION_CHARS, cut_texts, last_tag_block, tag_spans
from mmgrpo.rewards._math import numeric_value, parse_math, parse_number
from mmgrpo.rewards.accuracy import AccuracyReward, choice_letter
from mmgrpo.rewards.box_iou import BoxIoU, parse_boxes
from mmgrpo.rewards.composite import CompositeReward
from mmgrpo.rewards.format import BOXED_PATTERN, R1_PATTERN, FormatReward, boxed_layout, r1_layout
from mmgrpo.rewards.seg_zero import SegZero
from mmgrpo.rewards.step_rar import StepRARReward
from mmgrpo.rewards.step_rvr import StepRVRReward
from mmgrpo.rewards.tiou import TIoU
from mmgrpo.types import PromptBatch

MB = 1_000_000
LIMIT_S = 10.0  # for one 1 MB input: checks termination, not speed (0.01 to 1 s each on 2 shared cores)


def _repeat(unit: str, size: int = MB) -> str:
    return (unit * (size // len(unit) + 1))[:size]


# 1 MB each; the regex parsers these replaced needed from tens of seconds to hours on every one of them
ADVERSARIAL = {
    "repeated <think>": _repeat("<think>"),
    "unclosed <answer>": _repeat("<answer>"),
    "</think> <answer> after one <think>": "<think>" + _repeat("</think> <answer>"),
    "layouts without an end": _repeat("<think></think><answer></answer>x"),
    "digits then /2": "1" * MB + "/2",
    "digits then %": "1" * MB + "x%",
    "[ then digits": "[" + "1" * MB,
    "1/1/1/": _repeat("1/"),
    "((((": "(" * MB,
    "\\boxed{ repeated": _repeat("\\boxed{"),
    "<think> then \\boxed{ repeated": "<think>a</think>" + _repeat("\\boxed{"),
    "'answer' then white space": "the answer" + " " * MB + "!",
    "long number with exponent": "1" * (MB // 2) + "e" + "9" * (MB // 2),
    "[1,2,3,4] repeated": _repeat("[1,2,3,4]"),
    "unclosed <box>": _repeat("<box>"),
}

# every reward that reads model text: class, options, per-sample metadata
TEXT_REWARDS = {
    "format r1": (FormatReward, {}, {}),
    "format boxed": (FormatReward, {"pattern": "boxed", "unique_tags": ["think"]}, {}),
    "accuracy numeric": (AccuracyReward, {"mode": "numeric"}, {"answer": "42"}),
    "accuracy math": (AccuracyReward, {"mode": "math"}, {"answer": "\\frac{1}{2}"}),
    "accuracy choice": (AccuracyReward, {"mode": "choice"}, {"answer": "B", "choices": ["red", "blue"]}),
    "box_iou": (BoxIoU, {"coords": "original"}, {"boxes": [[10, 10, 20, 20]]}),
    "step_rar": (StepRARReward, {}, {"key_steps": ["count the red circles", ["2", "two"]]}),
    "step_rvr": (StepRVRReward, {}, {}),
    "seg_zero": (SegZero, {}, {"boxes": [[10, 10, 20, 20]], "image_size": [64, 64], "input_size": [64, 64]}),
    "tiou": (TIoU, {}, {"span": [1.0, 3.0], "duration": 4.0}),
}
# text rewards whose parsers are tested on these inputs elsewhere, because they need a model to build: sam_mask (its
# Seg-Zero / Seg-R1 parsers run on the same megabyte inputs in test_seg_parse.py)
TESTED_ELSEWHERE = {"sam_mask"}


@contextmanager
def deadline(seconds: float):
    """Raises TimeoutError in the block after `seconds` (the regex engine checks signals, so a stuck match stops)."""

    def stop(signum, frame):
        raise TimeoutError(f"still parsing after {seconds} s")

    previous = signal.signal(signal.SIGALRM, stop)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def run(name: str, texts: list, **options):
    cls, defaults, metadata = TEXT_REWARDS[name]
    reward = cls(cls.Config(**{**defaults, **options}))
    return reward({"texts": texts}, PromptBatch(["p"] * len(texts), metadata=[metadata] * len(texts)))


def test_every_text_reward_is_covered_and_has_the_cap():
    text_rewards = {n for n in registry.available("reward") if "text" in registry.get("reward", n).modalities}
    text_rewards -= TESTED_ELSEWHERE
    covered = {cls for cls, _, _ in TEXT_REWARDS.values()}
    assert {registry.get("reward", n) for n in text_rewards} <= covered
    for cls in covered:
        assert cls.Config().max_completion_chars == MAX_COMPLETION_CHARS


@pytest.mark.parametrize("name", TEXT_REWARDS)
def test_megabyte_adversarial_inputs_finish_with_the_cap_off(name):
    for shape, text in ADVERSARIAL.items():
        started = time.monotonic()
        with deadline(LIMIT_S):
            result = run(name, [text], max_completion_chars=0)
        assert time.monotonic() - started < LIMIT_S, shape
        score = float(result.scores[0])
        assert 0.0 <= score <= 1.0, shape  # defined (not NaN) and in the reward's range
        assert result.components["truncated"].tolist() == [0.0], shape


def test_long_ground_truths_are_read_in_linear_time_too():
    reward = AccuracyReward(AccuracyReward.Config(mode="auto"))
    truths = ["1" + " " * MB + "x", " " * MB + "%x", "1" * MB + "/2"]  # a dataset file is input as well
    batch = PromptBatch(["p"] * len(truths), metadata=[{"answer": truth} for truth in truths])
    with deadline(LIMIT_S):
        scores = reward({"texts": ["<answer>1</answer>"] * len(truths)}, batch).scores
    assert scores.tolist() == [0.0, 0.0, 0.0]


@pytest.mark.parametrize("name", TEXT_REWARDS)
def test_the_cap_cuts_and_counts(name):
    texts = ["x" * 999, "x" * 1000, "<answer>" * 200, ADVERSARIAL["unclosed <answer>"], None]
    result = run(name, texts, max_completion_chars=1000)
    assert result.components["truncated"].tolist() == [0.0, 0.0, 1.0, 1.0, 0.0]
    assert torch.isfinite(result.scores).all()


def test_the_cap_applies_before_parsing():
    text = "<think>" + "x" * 2000 + "</think><answer>42</answer>"  # the answer lies beyond 1000 characters
    for cap, expected in ((0, 1.0), (None, 1.0), (4000, 1.0), (1000, 0.0)):
        assert run("format r1", [text], max_completion_chars=cap).scores.tolist() == [expected]
        assert run("accuracy numeric", [text], max_completion_chars=cap).scores.tolist() == [expected]


def test_composite_reports_the_cut_of_each_text_reward():
    reward = CompositeReward(CompositeReward.Config(rewards={
        "format": {"max_completion_chars": 100}, "accuracy": {"mode": "numeric", "max_completion_chars": 0}}))
    texts = ["<think>a</think><answer>4</answer>", "<think>" + "y" * 200 + "</think><answer>4</answer>"]
    result = reward({"texts": texts}, PromptBatch(["p", "p"], metadata=[{"answer": "4"}] * 2))
    assert result.components["format/truncated"].tolist() == [0.0, 1.0]
    assert result.components["accuracy/truncated"].tolist() == [0.0, 0.0]
    assert result.components["format"].tolist() == [1.0, 0.0] and result.components["accuracy"].tolist() == [1.0, 1.0]


# ---------------------------------------------------------------------------------------------- property-based
PROPERTY = settings(derandomize=True, max_examples=200, deadline=None, database=None)
PIECES = ["<think>", "</think>", "<answer>", "</answer>", "<box>", "</box>", "\\boxed{", "{", "}", "[", "]", "(", ")",
          ",", " ", "\n", "\u2003", "1", "2.5", "-3", "e5", "%", "/", "a", "B", "answer is", ":"]
TEXTS = st.lists(st.sampled_from(PIECES), max_size=16).map("".join)
PROSE = st.lists(st.sampled_from([p for p in PIECES if "<" not in p]), max_size=16).map("".join)  # no tags
JUNK = TEXTS.filter(lambda s: "<answer>" not in s)  # appended after a closed answer, it cannot open a new one
NUMBERS = st.integers(-10**12, 10**12) | st.floats(-1e9, 1e9, allow_nan=False).map(lambda x: round(x, 4))


@PROPERTY
@given(TEXTS)
def test_scanners_agree_with_the_regexes_they_replace(text):
    blocks = re.findall(r"<answer>(.*?)</answer>", text, re.DOTALL)
    assert last_tag_block(text, "answer") == (blocks[-1] if blocks else None)
    boxes = re.findall(r"<box>(.*?)</box>", text, re.DOTALL)
    assert [text[begin:end] for begin, end in tag_spans(text, "<box>", "</box>")] == boxes
    assert r1_layout(text) == (re.fullmatch(R1_PATTERN, text, re.DOTALL) is not None)
    assert boxed_layout(text) == (re.fullmatch(BOXED_PATTERN, text, re.DOTALL) is not None)


@PROPERTY
@given(NUMBERS, PROSE, JUNK)
def test_a_well_formed_number_is_recovered_and_junk_after_the_answer_is_ignored(value, think, junk):
    text = f"<think>{think}</think><answer>{value}</answer>"
    assert last_tag_block(text + junk, "answer") == str(value)
    assert parse_number(str(value)) == float(value)
    scores = run("accuracy numeric", [text, text + junk], max_completion_chars=0).scores  # truth 42
    assert scores.tolist() == [float(abs(value - 42) <= 1e-8 + 1e-4 * 42)] * 2
    assert run("format r1", [text]).scores.tolist() == [1.0]


def expression_value(text: str) -> float | None:
    """What `numeric_value` computes through the expression path (sympy), for a text that parses as a number."""
    expression = parse_math(text)
    return None if expression is None or not expression.is_number else complex(expression.evalf()).real


DECIMALS = st.from_regex(r"[-+]?([0-9]{1,15}(\.[0-9]{0,15})?|\.[0-9]{1,15})", fullmatch=True)


@PROPERTY
@given(DECIMALS, st.sampled_from(["", " ", "\n"]))
def test_plain_decimals_read_directly_equal_the_expression_path(text, pad):
    value = numeric_value(pad + text + pad)
    expected = expression_value(text)  # None for "007" (not a Python literal): parse_number reads those
    if sum(c.isdigit() for c in text) <= 15:
        assert value == float(text)  # the correctly rounded double
    # sympy's 15-digit evaluation can round the last bit the other way (".010011" -> 0.010010999999999999)
    assert value == pytest.approx(float(text) if expected is None else expected, rel=1e-15, abs=0)


def test_plain_decimals_skip_the_expression_parser(monkeypatch):
    from mmgrpo.rewards import _math

    monkeypatch.setattr(_math, "parse_math", lambda text: pytest.fail(f"parsed {text!r}"))
    assert [numeric_value(t) for t in ["42", "-0.5", " .25 ", "+3.", "123456789012345"]] == [42.0, -0.5, 0.25, 3.0,
                                                                                          123456789012345.0]
    monkeypatch.undo()
    assert numeric_value("1234567890123456") == 1234567890123456.0  # 16 digits: the expression path, same value here
    assert numeric_value("\\frac{84}{2}") == 42.0 and numeric_value("the answer is 42.") == 42.0


@PROPERTY
@given(st.lists(st.tuples(*[st.integers(0, 4000)] * 4), min_size=1, max_size=5), PROSE, JUNK)
def test_well_formed_boxes_are_recovered_and_junk_after_the_answer_is_ignored(boxes, think, junk):
    answer = json.dumps([{"bbox_2d": list(box), "label": "object"} for box in boxes])
    text = f"<think>{think}</think><answer>{answer}</answer>"
    expected = [[float(x) for x in box] for box in boxes]
    assert parse_boxes(text) == parse_boxes(text + junk) == expected


@PROPERTY
@given(st.sampled_from("ABCDEFGH"), JUNK)
def test_a_named_option_letter_is_recovered(letter, junk):
    assert choice_letter(f"The answer is ({letter}).") == letter
    assert run("accuracy choice", [f"<answer>{letter}</answer>{junk}"]).scores.tolist() == [float(letter == "B")]


@settings(derandomize=True, max_examples=60, deadline=None, database=None)
@given(st.text(max_size=40) | TEXTS)
def test_arbitrary_text_scores_in_range_without_error(text):
    for name in TEXT_REWARDS:
        result = run(name, [text])
        assert 0.0 <= float(result.scores[0]) <= 1.0, name


@PROPERTY
@given(st.lists(st.none() | st.text(max_size=30), max_size=6), st.integers(0, 40))
def test_cut_texts_keeps_the_head_and_flags_exactly_the_cut(entries, cap):
    out, truncated = cut_texts(entries, cap)
    for before, after, flag in zip(entries, out, truncated.tolist()):
        if before is None or not cap:
            assert after == before and flag == 0.0
        else:
            assert after == before[:cap] and flag == float(len(before) > cap)
