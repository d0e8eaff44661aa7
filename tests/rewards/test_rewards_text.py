"""format and accuracy: layouts, answer extraction, each comparison mode, malformed and unsafe answers."""

import math
import re
import time

import pytest

from mmgrpo.rewards.accuracy import AccuracyReward, choice_letter
from mmgrpo.rewards.format import FormatReward
from mmgrpo.types import PromptBatch


def fmt(texts, **options):
    result = FormatReward(FormatReward.Config(**options))({"texts": texts}, PromptBatch(["p"] * len(texts)))
    return result.scores.tolist(), result.components["malformed"].tolist()


def acc(text, answer, **options):
    metadata = options.pop("metadata", {})
    reward = AccuracyReward(AccuracyReward.Config(**options))
    result = reward({"texts": [text]}, PromptBatch(["p"], metadata=[{"answer": answer, **metadata}]))
    return float(result.scores[0]), {k: float(v[0]) for k, v in result.components.items()}


def test_format_r1_layout():
    scores, malformed = fmt([
        "<think>reason</think><answer>4</answer>",
        "  <think>multi\nline</think>\n<answer>4</answer>\n",
        "<answer>4</answer>",
        "<think>a</think><think>b</think><answer>4</answer>",  # think repeated
        "<think>a</think><answer>4</answer> trailing text",
        "",
        None,
    ])
    assert scores == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    assert malformed == [0.0] * 6 + [1.0]


def test_format_configurable_patterns():
    box = r"\[\s*\d+\s*,\s*\d+\s*,\s*\d+\s*,\s*\d+\s*\]"
    scores, _ = fmt(["<think>a</think><answer>[1, 2, 3, 4]</answer>", "<think>a</think><answer>none</answer>"],
                    answer_pattern=box)
    assert scores == [1.0, 0.0]
    boxed = r"<think>.*</think>.*\\boxed\{.*\}.*"  # EasyR1's math layout
    scores, _ = fmt(["<think>a</think> so \\boxed{3}", "\\boxed{3}"], pattern=boxed, unique_tags=["think"])
    assert scores == [1.0, 0.0]
    with pytest.raises(ValueError, match="pattern"):
        FormatReward.Config(pattern="(unclosed")


def test_exact_mode_and_answer_extraction():
    assert acc("<answer> Paris. </answer>", "paris", mode="exact")[0] == 1.0
    assert acc("<think>London?</think><answer>Paris</answer>", "Paris", mode="exact")[0] == 1.0
    assert acc("<answer>paris</answer>", "Paris", mode="exact", case_sensitive=True)[0] == 0.0
    value, parts = acc("so it is \\boxed{Paris}", "Paris", mode="exact")
    assert value == 1.0 and parts["tagged"] == 1.0
    value, parts = acc("Paris", "Paris", mode="exact")
    assert value == 1.0 and parts["tagged"] == 0.0
    value, parts = acc("Paris", "Paris", mode="exact", require_tag=True)
    assert value == 0.0 and parts["malformed"] == 1.0


def test_numeric_mode_with_tolerance_and_closeness():
    assert acc("<answer>The total is 1,234.5 dollars.</answer>", "1234.5")[0] == 1.0
    assert acc("<answer>45%</answer>", "0.45", mode="numeric")[0] == 1.0
    assert acc("<answer>3/4</answer>", "0.75", mode="numeric")[0] == 1.0
    assert acc("<answer>\\frac{84}{2}</answer>", "42", mode="numeric")[0] == 1.0
    assert acc("<answer>3.14159</answer>", "3.1415926", mode="numeric", rtol=1e-4)[0] == 1.0
    assert acc("<answer>3.2</answer>", "3.1415926", mode="numeric", rtol=1e-4)[0] == 0.0
    # closeness: e = |90 - 100| / 100 = 0.1, width 0.5 -> 1 - 0.1 / 0.5 = 0.8
    assert acc("<answer>90</answer>", "100", mode="numeric", fuzzy_width=0.5)[0] == pytest.approx(0.8)
    assert acc("<answer>10</answer>", "100", mode="numeric", fuzzy_width=0.5)[0] == 0.0
    value, parts = acc("<answer>many</answer>", "100", mode="numeric")
    assert value == 0.0 and parts["malformed"] == 1.0


@pytest.mark.parametrize("text", ["B", "(B)", "b", "B. blue", "The answer is (B).", "I pick option B", "blue"])
def test_choice_mode_variants(text):
    options = {"metadata": {"choices": ["red", "blue", "green"]}}
    assert acc(f"<answer>{text}</answer>", "B", **options)[0] == 1.0
    assert acc(f"<answer>{text}</answer>", "C", **options)[0] == 0.0


def test_choice_without_a_letter_is_malformed():
    assert choice_letter("no idea") is None
    value, parts = acc("<answer>no idea</answer>", "A", mode="choice")
    assert value == 0.0 and parts["malformed"] == 1.0


@pytest.mark.parametrize(
    "answer, truth",
    [("\\frac{1}{2}", "0.5"), ("1/2", "\\dfrac{1}{2}"), ("2x + x", "3x"), ("\\sqrt{8}", "2\\sqrt{2}"),
     ("x = 5", "5"), ("(x+1)(x-1)", "x^2 - 1"), ("$\\pi$", "\\pi"), ("(1, 2)", "(1,2)")],
)
def test_math_equivalence(answer, truth):
    assert acc(f"<answer>{answer}</answer>", truth, mode="math")[0] == 1.0


def test_math_wrong_unparseable_and_unsafe_answers():
    assert acc("<answer>2x</answer>", "3x", mode="math")[0] == 0.0
    value, parts = acc("<answer>__import__('os').system('true')</answer>", "3x", mode="math")
    assert value == 0.0 and parts["malformed"] == 1.0  # never evaluated
    started = time.monotonic()
    assert acc("<answer>((9^64)^64)^64</answer>", "1", mode="math")[0] == 0.0  # bounded powers
    assert time.monotonic() - started < 5


def test_auto_mode_per_sample_types_lists_and_not_applicable():
    assert acc("<answer>42</answer>", "42.0")[0] == 1.0  # numeric
    assert acc("<answer>(C)</answer>", "C")[0] == 1.0  # choice
    assert acc("<answer>\\frac{2}{4}</answer>", "\\frac{1}{2}")[0] == 1.0  # math
    assert acc("<answer>Blue Whale</answer>", "blue whale")[0] == 1.0  # exact
    assert acc("<answer>0.5</answer>", "1/2", metadata={"answer_type": "exact"})[0] == 0.0
    assert acc("<answer>five</answer>", ["5", "five"])[0] == 1.0  # any acceptable answer
    reward = AccuracyReward()
    result = reward({"texts": ["<answer>1</answer>", None]}, PromptBatch(["a", "b"], metadata=[{}, {"answer": "1"}]))
    assert math.isnan(result.scores[0]) and result.scores[1] == 0.0 and result.components["malformed"][1] == 1.0


@pytest.mark.parametrize(
    "options, key",
    [
        ({"max_completion_chars": -1}, "max_completion_chars"),
        ({"max_completion_chars": 1.5}, "max_completion_chars"),
        ({"max_completion_chars": True}, "max_completion_chars"),
        ({"max_completion_chars": "4096"}, "max_completion_chars"),
        ({"unique_tags": ["think", ""]}, r"unique_tags\[1\]"),
        ({"unique_tags": ["<think>"]}, r"unique_tags\[0\]"),
        ({"unique_tags": "think"}, "unique_tags"),
        ({"pattern": ""}, "pattern"),
        ({"pattern": 3}, "pattern"),
        ({"pattern": "<a>.*", "max_completion_chars": 0}, "max_completion_chars"),  # a custom regex needs the cap
        ({"answer_pattern": r"\d+", "max_completion_chars": None}, "max_completion_chars"),
    ],
)
def test_format_config_refuses_unusable_values_naming_the_key(options, key):
    with pytest.raises(ValueError, match=key):
        FormatReward.Config(**options)


def test_format_layout_names_and_their_regexes_agree():
    from mmgrpo.rewards.format import BOXED_PATTERN, R1_PATTERN

    texts = ["<think>a</think><answer>4</answer>", " <think>a</think>\n<answer>4</answer> ", "<answer>4</answer>",
             "<think>a</think><answer>4", "<think>a</think> \\boxed{3}", "x<think>a</think> \\boxed{3}"]
    for name, regex in (("r1", R1_PATTERN), ("boxed", BOXED_PATTERN)):
        by_name, _ = fmt(texts, pattern=name, unique_tags=[], max_completion_chars=0)  # no cap: the layouts are linear
        by_regex, _ = fmt(texts, pattern=regex, unique_tags=[])
        assert by_name == by_regex == [float(re.fullmatch(regex, t, re.DOTALL) is not None) for t in texts]


@pytest.mark.parametrize(
    "options, key",
    [
        ({"rtol": float("nan")}, "rtol"),
        ({"atol": float("inf")}, "atol"),
        ({"fuzzy_width": "wide"}, "fuzzy_width"),
        ({"mode": "fuzzy"}, "mode"),
        ({"answer_key": ""}, "answer_key"),
        ({"answer_tag": "<answer>"}, "answer_tag"),
        ({"answer_tag": " "}, "answer_tag"),
        ({"boxed": "yes"}, "boxed"),
        ({"require_tag": 1}, "require_tag"),
        ({"max_completion_chars": -5}, "max_completion_chars"),
    ],
)
def test_accuracy_config_refuses_unusable_values_naming_the_key(options, key):
    with pytest.raises(ValueError, match=key):
        AccuracyReward.Config(**options)


def test_text_reward_configs_accept_no_cap():
    for config in (FormatReward.Config(max_completion_chars=0), AccuracyReward.Config(max_completion_chars=None)):
        assert not config.max_completion_chars
