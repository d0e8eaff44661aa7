"""Seg-Zero and Seg-R1 answer parsing: the mapping from the model's frame to original pixels (hand values), the
grouping of Seg-R1 points by box, a defined result and counter for every kind of malformed answer, and property tests
(hypothesis) that the parsers never raise and finish on 1 MB adversarial texts (linear)."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mmgrpo.rewards._seg_parse import COUNTERS, parse_prompt
from mmgrpo.rewards.box_iou import BoxIoU
from test_rewards_adversarial import ADVERSARIAL, LIMIT_S, MB, deadline

# original image 200 x 100 seen by the model at 100 x 50: every coordinate doubles
RESIZED = {"image_size": [200, 100], "input_size": [100, 50]}


def parse(text, answer_format="seg_zero", coords="resized", metadata=RESIZED, **limits):
    return parse_prompt(text, answer_format, BoxIoU(BoxIoU.Config(coords=coords)), dict(metadata), 0, **limits)


def raised(prompt):
    return {name for name, value in prompt.counters.items() if value}


def test_seg_zero_maps_box_and_points_from_the_resized_frame():
    text = '<think>the cat</think><answer>{"bbox": [10, 5, 30, 20], "points_1": [12, 8], "points_2": [25, 15]}</answer>'
    prompt = parse(text)
    assert prompt.boxes == [[20.0, 10.0, 60.0, 40.0]]  # x * 200 / 100, y * 100 / 50
    assert prompt.points == [[[24.0, 16.0], [50.0, 30.0]]]
    assert prompt.labels == [[1, 1]]
    assert raised(prompt) == set()


@pytest.mark.parametrize("coords, box, expected", [
    ("original", [20, 10, 60, 40], [20, 10, 60, 40]),
    ("norm1000", [100, 100, 300, 400], [20, 10, 60, 40]),  # x * 200 / 1000, y * 100 / 1000
    ("norm1", [0.1, 0.1, 0.3, 0.4], [20, 10, 60, 40]),
])
def test_the_other_frames_of_box_iou(coords, box, expected):
    prompt = parse(f'<answer>{{"bbox": {box}}}</answer>', coords=coords)
    assert prompt.boxes == [pytest.approx(expected)]
    assert prompt.points == [[]]


def test_vision_reasoner_lists_of_objects_are_read():
    text = ('<answer>[{"bbox_2d": [0, 0, 10, 10], "point_2d": [5, 5]}, '
            '{"bbox_2d": [20, 20, 40, 40], "point_2d": [30, 30]}]</answer>')
    prompt = parse(text, coords="original")
    assert prompt.boxes == [[0, 0, 10, 10], [20, 20, 40, 40]]
    assert prompt.points == [[[5, 5]], [[30, 30]]]


def test_seg_r1_groups_points_by_the_first_box_containing_them():
    text = ("<think>two parts</think><bbox>[0,0,50,50]</bbox><bbox>[40,40,100,90]</bbox>"
            "<points>[[10,10],[45,45],[90,80],[150,20]]</points><labels>[1,0,1,1]</labels>")
    prompt = parse(text, "seg_r1", coords="original")
    assert prompt.boxes == [[0, 0, 50, 50], [40, 40, 100, 90]]
    assert prompt.points == [[[10, 10], [45, 45]], [[90, 80]]]  # (45, 45) is in both: the first box takes it
    assert prompt.labels == [[1, 0], [1]]
    assert raised(prompt) == {"points_unassigned"}  # (150, 20) is in the image but in no box


def test_seg_r1_several_boxes_in_one_tag_and_labels_of_another_length():
    prompt = parse("<bbox>[[0,0,10,10],[20,20,30,30]]</bbox><points>[[5,5],[25,25]]</points><labels>[1]</labels>",
                   "seg_r1", coords="original")
    assert prompt.boxes == [[0, 0, 10, 10], [20, 20, 30, 30]]
    assert prompt.labels == [[1], [1]]  # mismatched labels: every point is foreground
    assert raised(prompt) == {"bad_labels"}


@pytest.mark.parametrize("text, answer_format, counters, boxes", [
    ("no answer at all", "seg_zero", {"no_answer", "no_box"}, 0),
    ("<answer>not json</answer>", "seg_zero", {"bad_json", "no_box"}, 0),
    ('<answer>{"bbox": [1, 2, 3]}</answer>', "seg_zero", {"bad_json", "no_box"}, 0),
    ('<answer>{"bbox": [1, 1, 9, 9]}</answer><answer>{"bbox": [1, 1, 9, 9]}</answer>', "seg_zero",
     {"several_answers", "no_box"}, 0),
    ('<answer>{"bbox": [NaN, 1, 9, 9]}</answer>', "seg_zero", {"non_finite", "no_box"}, 0),
    ('<answer>{"bbox": [9, 9, 1, 1]}</answer>', "seg_zero", {"inverted", "no_box"}, 0),
    ('<answer>{"bbox": [-5, 1, 500, 9], "points_1": [3, 3], "points_2": [300, 3]}</answer>', "seg_zero",
     {"clipped", "points_outside"}, 1),
    ('<answer>{"bbox": [1, 1, 9, 9], "points_1": [1e999, 3], "points_2": [3, 3]}</answer>', "seg_zero",
     {"non_finite"}, 1),
    ("<bbox>junk</bbox><points>[[1,1]]</points>", "seg_r1", {"no_box", "bad_labels"}, 0),  # labels missing
    ("<points>[[1,1]]</points>", "seg_r1", {"no_answer", "no_box", "bad_labels"}, 0),
    (None, "seg_r1", {"no_answer", "no_box"}, 0),
])
def test_malformed_answers_get_a_defined_result_and_counters(text, answer_format, counters, boxes):
    prompt = parse(text, answer_format, coords="original")
    assert raised(prompt) == counters
    assert len(prompt.boxes) == boxes == len(prompt.points) == len(prompt.labels)
    for box in prompt.boxes:  # what is kept lies in the image
        assert 0 <= box[0] <= box[2] <= 200 and 0 <= box[1] <= box[3] <= 100


def test_a_missing_frame_size_names_the_key():
    with pytest.raises(ValueError, match="input_size"):
        parse('<answer>{"bbox": [1, 1, 9, 9]}</answer>', metadata={"image_size": [200, 100]})


TAGS = st.sampled_from(["<answer>", "</answer>", "<bbox>", "</bbox>", "<points>", "</points>", "<labels>",
                        "</labels>", "{", "}", "[", "]", ",", '"bbox":', '"points_1":', "NaN", "1e999", "-3", "7.5"])


@settings(max_examples=300, deadline=None, derandomize=True)
@given(parts=st.lists(st.one_of(TAGS, st.text(max_size=8)), max_size=40),
       answer_format=st.sampled_from(["seg_zero", "seg_r1"]))
def test_parsers_never_raise_and_keep_only_valid_prompts(parts, answer_format):
    prompt = parse("".join(parts), answer_format, coords="original", max_boxes=4, max_points=8)
    assert set(prompt.counters) == set(COUNTERS) and set(prompt.counters.values()) <= {0.0, 1.0}
    assert len(prompt.boxes) <= 4 and prompt.counters["no_box"] == float(not prompt.boxes)
    for box, points, labels in zip(prompt.boxes, prompt.points, prompt.labels):
        assert 0 <= box[0] <= box[2] <= 200 and 0 <= box[1] <= box[3] <= 100
        assert len(points) == len(labels) and set(labels) <= {0, 1}
        assert all(0 <= x <= 200 and 0 <= y <= 100 for x, y in points)


SEG_ADVERSARIAL = {**ADVERSARIAL, "unclosed <bbox>": "<bbox>" * (MB // 6),
                   "[[ then digits": "<points>[[" + "1," * (MB // 2),
                   "answer with a deep JSON list": "<answer>" + "[" * MB + "</answer>"}


@pytest.mark.parametrize("name", sorted(SEG_ADVERSARIAL))
@pytest.mark.parametrize("answer_format", ["seg_zero", "seg_r1"])
def test_parsers_finish_on_one_megabyte_adversarial_texts(name, answer_format):
    with deadline(LIMIT_S):
        prompt = parse(SEG_ADVERSARIAL[name], answer_format, coords="original")
    assert set(prompt.counters) == set(COUNTERS)
