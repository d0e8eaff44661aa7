"""accuracy's math mode with the optional `math_verify` backend: the cases where it and the built-in parser differ,
the cases where they agree, the length cap, a clear error without the extra, and no exception on any text."""

import sys

import pytest
from hypothesis import given, settings, strategies as st

from mmgrpo.rewards.accuracy import MATH_VERIFY_MAX_CHARS, AccuracyConfig, AccuracyReward

pytest.importorskip("math_verify", reason="the optional `math` extra (installed by .[test])")

BUILTIN = AccuracyReward(AccuracyConfig(mode="math"))
VERIFY = AccuracyReward(AccuracyConfig(mode="math", math_backend="math_verify"))

# (answer, truth, builtin score, builtin malformed, math_verify score): what each backend gives, worked out by hand
DIFFERENT = [
    ("[1, 2)", "[1,2)", 0.0, 1.0, 1.0),  # an interval: the built-in parser reads no interval
    ("\\{2, 1\\}", "\\{1, 2\\}", 0.0, 1.0, 1.0),  # a set, in another order
    ("3, 2, 1", "1, 2, 3", 0.0, 0.0, 1.0),  # an unordered tuple of answers
    ("(-\\infty, 3]", "x \\le 3", 0.0, 1.0, 1.0),  # an interval answering an inequality
]
SAME = [
    ("\\frac{1}{2}", "0.5", 1.0),
    ("2\\sqrt{2}", "\\sqrt{8}", 1.0),
    ("(x+1)^2", "x^2+2x+1", 1.0),
    ("(1, 2]", "[1, 2)", 0.0),  # different intervals are different for both (the built-in one cannot tell: 0)
    ("7", "8", 0.0),
]


def score(reward, answer, truth):
    return reward.score_one(f"<think>t</think><answer>{answer}</answer>", truth, {})


@pytest.mark.parametrize("answer, truth, builtin, builtin_malformed, verified", DIFFERENT)
def test_where_the_backends_differ(answer, truth, builtin, builtin_malformed, verified):
    assert score(BUILTIN, answer, truth) == {"score": builtin, "malformed": builtin_malformed, "tagged": 1.0}
    assert score(VERIFY, answer, truth)["score"] == verified


@pytest.mark.parametrize("answer, truth, expected", SAME)
def test_where_the_backends_agree(answer, truth, expected):
    assert score(BUILTIN, answer, truth)["score"] == expected
    assert score(VERIFY, answer, truth)["score"] == expected


def test_long_math_answers_are_malformed_not_parsed():
    long = "1+" * (MATH_VERIFY_MAX_CHARS // 2) + "1"
    assert score(VERIFY, long, str(MATH_VERIFY_MAX_CHARS // 2 + 1)) == {"score": 0.0, "malformed": 1.0, "tagged": 1.0}


def test_auto_mode_sends_intervals_to_math_verify():
    auto = AccuracyReward(AccuracyConfig(math_backend="math_verify"))
    assert score(auto, "[1, 2)", "[1,2)")["score"] == 1.0


def test_missing_extra_is_a_config_error_naming_the_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "math_verify", None)  # as if not installed: importing it raises ImportError
    with pytest.raises(ValueError, match=r'pip install "mmgrpo\[math\]"'):
        AccuracyConfig(math_backend="math_verify")


@settings(max_examples=60, deadline=None)
@given(st.text(alphabet="0123456789+-*/^()[]{}\\,.=<>x fracsqrtinfty$", max_size=40), st.sampled_from(["1/2", "[1,2)"]))
def test_math_verify_never_raises(answer, truth):
    result = score(VERIFY, answer, truth)
    assert result["score"] in (0.0, 1.0) and result["malformed"] in (0.0, 1.0)
