"""StepGRPO's step rewards: StepRAR (share of the key steps the reasoning contains) and StepRVR (complete and ordered
reasoning): R1-VL's rules (the defaults) on the worked examples and against an independent transcription of R1-VL's
published rules on generated texts; mmgrpo's stricter variants on hand examples whose scores are counted by hand;
their documented edge cases, property tests that they never raise on any text and stay in their range, and a bound on
their work for long adversarial texts."""

import pytest
import torch
from hypothesis import given, settings, strategies as st

from mmgrpo import registry
from mmgrpo.types import PromptBatch

R1VL = """### Image Description:
Three red circles and one blue square.
### Rationales:
Count the red shapes.
### Step 1:
There are 3 red circles.
### Step 2:
No other red shape, so 3 + 0 = 3.
### The final answer is: 3"""


def reward(name, **options):
    cls = registry.get("reward", name)
    return cls(cls.Config(**options))


def rar_scores(texts, key_steps, **options):
    batch = PromptBatch(["q"] * len(texts), metadata=[{"key_steps": key_steps} for _ in texts])
    return reward("step_rar", **options)({"texts": texts}, batch)


SQUEEZED_THINK = {"scope": "think", "squeeze_whitespace": True}  # mmgrpo's variant: the last <think> block, squeezed


def test_step_rar_variant_hand_examples():
    key_steps = ["3 red circles", ["3+0=3", "three plus zero"], "blue square", "x = 7"]
    texts = [
        "<think>I see 3 Red  Circles; 3 + 0 = 3.</think><answer>3</answer>",  # 2 of 4 (case and spaces ignored)
        "<think>three plus zero, a blue square, 3 red circles</think>x = 7",  # 3 of 4: x = 7 is outside <think>
        "3 red circles, blue square, x=7, 3+0=3",  # no <think> block: 0, no_reasoning
        "<think>nothing</think>",
        None,  # not a string
    ]
    out = rar_scores(texts, key_steps, **SQUEEZED_THINK)
    torch.testing.assert_close(out.scores, torch.tensor([0.5, 0.75, 0.0, 0.0, 0.0]))
    torch.testing.assert_close(out.components["matched"], torch.tensor([2.0, 3.0, 0.0, 0.0, 0.0]))
    torch.testing.assert_close(out.components["no_reasoning"], torch.tensor([0.0, 0.0, 1.0, 0.0, 1.0]))
    torch.testing.assert_close(out.components["malformed"], torch.tensor([0.0, 0.0, 0.0, 0.0, 1.0]))
    assert torch.all(out.components["key_steps"] == 4)
    whole = rar_scores(texts[2:3], key_steps, scope="all", squeeze_whitespace=True)
    assert whole.scores.tolist() == [1.0]  # every key step, looked for in the whole text


def test_step_rar_on_the_r1_vl_layout_and_the_last_think_block():
    out = rar_scores([R1VL, "<think>3 red circles</think> <think>none</think>"], ["3 red circles", "3 + 0 = 3"],
                     scope="all")
    assert out.scores.tolist() == [1.0, 0.5]
    last = rar_scores(["<think>3 red circles</think> <think>none</think>"], ["3 red circles"], scope="think")
    assert last.scores.tolist() == [0.0]  # the reasoning is the last <think> block


def test_step_rar_not_applicable_and_bad_metadata():
    batch = PromptBatch(["a", "b", "c"], metadata=[{}, {"key_steps": []}, {"key_steps": ["x"]}])
    out = reward("step_rar", scope="think")({"texts": ["<think>x</think>"] * 3}, batch)
    assert torch.isnan(out.scores[:2]).all() and out.scores[2] == 1.0
    for bad, message in [("x", "must be a list"), ([3], "must be a string or a non-empty list"),
                         ([[]], "non-empty list"), (["  "], "only white space"), (["y" * 300], "max_key_step_chars"),
                         (["s"] * 70, "max_key_steps")]:
        with pytest.raises(ValueError, match=message):
            reward("step_rar")({"texts": ["t"]}, PromptBatch(["q"], metadata=[{"key_steps": bad}]))


def rvr(texts, **options):
    return reward("step_rvr", **options)({"texts": texts}, PromptBatch(["q"] * len(texts)))


STRICT = {"part_order": True, "answer_check": "last"}  # mmgrpo's stricter variant


def test_step_rvr_variant_hand_examples():
    swapped = R1VL.replace("### Step 1:", "### Step X:").replace("### Step 2:", "### Step 1:").replace(
        "### Step X:", "### Step 2:")  # numbered 2, 1
    answer_first = "### Image Description:\nd\n### Rationales:\nr\n### The final answer is: 3\n### Step 1: s"
    rationale_first = R1VL.replace("### Image Description:", "### Tmp:").replace(
        "### Rationales:", "### Image Description:").replace("### Tmp:", "### Rationales:")
    skipped = R1VL.replace("### Step 2:", "### Step 3:")
    no_rationale = R1VL.replace("### Rationales:", "")
    texts = [R1VL, swapped, answer_first, rationale_first, skipped, no_rationale, "### Step 1: ok", None]
    out = rvr(texts, **STRICT)
    assert out.scores.tolist() == [1, 0, 0, 0, 0, 0, 0, 0]
    assert out.components["complete"].tolist() == [1, 1, 1, 1, 1, 0, 0, 0]
    assert out.components["logical"].tolist() == [1, 0, 0, 0, 0, 0, 0, 0]
    assert out.components["steps"].tolist() == [2, 2, 1, 2, 2, 2, 1, 0]
    assert out.components["malformed"].tolist() == [0, 0, 0, 0, 0, 0, 0, 1]
    # R1-VL's rules: the rationale before the description passes (where they are is not checked)
    assert rvr(texts).scores.tolist() == [1, 0, 0, 1, 0, 0, 0, 0]


def test_step_rvr_options():
    think = "<think>Step 1: look. Step 2: count.</think> Answer: 3"
    out = rvr([think, think.replace("Step 2", "Step 2a")], description_header="", rationale_header="",
              step_prefix="Step ", answer_header="Answer:", min_steps=2)
    assert out.scores.tolist() == [1.0, 0.0]  # "Step 2a" is not a step header: 1 step < min_steps
    assert rvr([R1VL], min_steps=3).scores.tolist() == [0.0]
    with pytest.raises(ValueError, match="step_prefix must be a non-empty header"):
        registry.get("reward", "step_rvr").Config(step_prefix=" ")


PIECES = list("#Step 1234:<>/thinkabcx=+\n") + ["### Step ", "<think>", "</think>", "### The final answer is:",
                                               "### Image Description:", "### Rationales:"]
TEXT = st.lists(st.sampled_from(PIECES), max_size=60).map("".join)
KEY_STEPS = st.lists(st.one_of(st.text(min_size=1, max_size=8).filter(str.strip),
                               st.lists(st.text(min_size=1, max_size=8).filter(str.strip), min_size=1, max_size=3)),
                     min_size=1, max_size=6)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.one_of(TEXT, st.text(max_size=200), st.none()), min_size=1, max_size=4), KEY_STEPS)
def test_property_never_raise_and_stay_in_range(texts, key_steps):
    rar = rar_scores(texts, key_steps, max_completion_chars=150)
    assert rar.scores.dtype == torch.float32 and ((rar.scores >= 0) & (rar.scores <= 1)).all()
    matched = rar.components["matched"]
    torch.testing.assert_close(rar.scores, matched / len(key_steps))  # k / K, k counted in `matched`
    out = rvr(texts, max_completion_chars=150)
    assert set(out.scores.tolist()) <= {0.0, 1.0}
    torch.testing.assert_close(out.scores, out.components["complete"] * out.components["logical"])


def test_long_adversarial_texts_are_cut_and_scanned_once():
    """A million repeated prefixes with no number after them and no closing tag: cut to the cap, scored quickly
    (the scans are linear; the cap bounds them)."""
    texts = ["### Step " * 200_000, "<think>" * 200_000, "### Step 1" * 100_000]
    out = rvr(texts)
    assert out.scores.tolist() == [0.0, 0.0, 0.0] and out.components["truncated"].tolist() == [1.0, 1.0, 1.0]
    uncut = rvr(texts, max_completion_chars=0)  # no cap: still linear, 0 step headers in each
    assert uncut.components["steps"].tolist() == [0.0, 0.0, 0.0]
    rar = rar_scores(texts, ["1", "step"], scope="all", max_completion_chars=0)
    assert rar.scores.tolist() == [0.5, 0.0, 1.0]
