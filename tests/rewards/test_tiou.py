"""tiou: hand-computed temporal IoUs, the notations a span is written in, and every malformed answer scored 0 and
counted."""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mmgrpo.rewards.tiou import TIoU, parse_span, temporal_iou
from mmgrpo.types import PromptBatch


def score(text, span=(1.0, 3.0), **metadata):
    reward = TIoU(TIoU.Config(**metadata.pop("config", {})))
    result = reward({"texts": [text]}, PromptBatch(["p"], metadata=[{"span": list(span), **metadata}]))
    return float(result.scores[0]), {k: float(v[0]) for k, v in result.components.items()}


def test_hand_computed_values():
    assert score("<answer>[1, 3]</answer>")[0] == 1.0
    # [2, 4] vs [1, 3]: intersection [2, 3] = 1, union [1, 4] = 3
    assert score("<answer>[2, 4]</answer>")[0] == pytest.approx(1 / 3)
    # [0, 1] vs [1, 3]: touching ends, no overlap
    assert score("<answer>[0, 1]</answer>")[0] == 0.0
    # [1.5, 2.5] inside [1, 3]: 1 / 2
    assert score("<answer>[1.5, 2.5]</answer>")[0] == pytest.approx(0.5)
    # [0, 10] vs [1, 3]: 2 / 10
    assert score("<answer>[0, 10]</answer>")[0] == pytest.approx(0.2)
    assert temporal_iou([2.0, 2.0], [2.0, 2.0]) == 1.0  # equal points
    assert temporal_iou([2.0, 2.0], [3.0, 3.0]) == 0.0
    assert temporal_iou([2.0, 2.0], [1.0, 3.0]) == 0.0  # a point inside a span: no length in common


@pytest.mark.parametrize("text", [
    "<answer>[1.0, 3.0]</answer>", "<answer>(1, 3)</answer>", "<answer>1 - 3</answer>", "<answer>1-3</answer>",
    "<answer>from 1 to 3 seconds</answer>", "<answer>1.0s-3.0s</answer>", "[1, 3]",
    "<think>the circle moves in the middle</think><answer>[1,3]</answer>",
])
def test_notations(text):
    value, parts = score(text)
    assert value == 1.0 and parts["no_span"] == 0.0


def test_the_last_answer_is_scored_and_several_are_counted():
    value, parts = score("<answer>[0, 1]</answer> no, <answer>[1, 3]</answer>")
    assert value == 1.0 and parts["several_answers"] == 1.0
    assert score("<answer>[1, 3]</answer>")[1]["several_answers"] == 0.0


@pytest.mark.parametrize("text, flag", [
    ("<answer></answer>", "no_span"),
    ("<answer>2</answer>", "no_span"),
    ("<answer>[1, 2, 3]</answer>", "no_span"),
    ("<answer>never</answer>", "no_span"),
    ("<answer>[nan, 3]</answer>", "no_span"),  # "nan" is not a number: one number left
    ("<answer>[1e999, 3]</answer>", "non_finite"),
    ("<answer>[3, 1]</answer>", "inverted"),
    (None, "no_span"),
])
def test_malformed_answers_score_zero_and_are_counted(text, flag):
    value, parts = score(text)
    assert value == 0.0 and parts[flag] == 1.0 and math.isnan(parts["tiou"])


def test_spans_outside_the_video_are_clipped_and_counted():
    value, parts = score("<answer>[2, 9]</answer>", span=(2.0, 4.0), duration=4.0)
    assert value == 1.0 and parts["clipped"] == 1.0  # [2, 9] -> [2, 4]
    value, parts = score("<answer>[2, 9]</answer>", span=(2.0, 4.0))  # no duration: nothing to clip to
    assert value == pytest.approx(2 / 7) and parts["clipped"] == 0.0


def test_samples_without_a_true_span_are_not_applicable():
    result = TIoU()({"texts": ["<answer>[1, 3]</answer>"] * 2},
                    PromptBatch(["p", "q"], metadata=[{"span": [1, 3]}, {}]))
    assert result.scores[0] == 1.0 and math.isnan(result.scores[1])


@pytest.mark.parametrize("truth", [[3, 1], [1], "1-3", [1, float("nan")]])
def test_a_bad_ground_truth_names_the_key_and_the_fix(truth):
    with pytest.raises(ValueError, match=r"tiou: metadata\['span'\] of sample 0 must be \[start, end\]"):
        TIoU()({"texts": ["[1, 3]"]}, PromptBatch(["p"], metadata=[{"span": truth}]))


def test_config_is_validated():
    with pytest.raises(Exception, match="answer_tag"):
        TIoU.Config(answer_tag="<answer>")


SPANS = st.tuples(st.floats(0, 100, allow_nan=False), st.floats(0, 100, allow_nan=False)).map(sorted)


@settings(derandomize=True, max_examples=200, deadline=None, database=None)
@given(SPANS, SPANS)
def test_tiou_is_symmetric_bounded_and_one_only_on_equal_spans(a, b):
    value = temporal_iou(a, b)
    assert 0.0 <= value <= 1.0
    assert value == pytest.approx(temporal_iou(b, a))
    if value == 1.0:
        assert a == pytest.approx(b)


@settings(derandomize=True, max_examples=200, deadline=None, database=None)
@given(st.integers(0, 10**6), st.integers(0, 10**6), st.text(max_size=30).filter(lambda t: not any(c.isdigit() for c in t)))
def test_a_written_span_is_recovered_whatever_the_reasoning(start, length, think):
    think = think.replace("<", "(")  # no stray tags in the reasoning
    span, flags = parse_span(f"<think>{think}</think><answer>[{start}, {start + length}]</answer>")
    assert span == [float(start), float(start + length)] and not any(flags.values())
