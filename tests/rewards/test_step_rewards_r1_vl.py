"""`step_rar` and `step_rvr` by default are R1-VL's StepRAR and StepRVR: the worked examples T1..T5 (numbers from
R1-VL's published rules), and on generated texts the same scores as an independent transcription of those rules (regular
expressions, as the rules are written), with the stricter mmgrpo variants' different answers where the examples show
them."""

import re

import pytest
import torch
from hypothesis import given, settings, strategies as st

from mmgrpo import registry
from mmgrpo.types import PromptBatch

T1 = ("### Image Description:\nA right triangle with legs 3 and 4.\n### Rationales:\nUse the Pythagorean theorem.\n"
      "### Let's think step by step.\n### Step 1:\nCompute 3^2 + 4^2 = 25.\n### Step 2:\nTake the square root: C = 5.\n"
      "### The final answer is: 5")
STEPS = ["3^2 + 4^2", "c=5", "Pythagorean", ["hypotenuse", "longest side"]]
T2 = T1.replace("### Image Description:\nA right triangle with legs 3 and 4.\n### Rationales:\nUse the Pythagorean "
                "theorem.\n", "### Rationales:\nUse the Pythagorean theorem.\n### Image Description:\nA right triangle "
                "with legs 3 and 4.\n")  # the rationale before the description
T3 = ("### Image Description: x\n### Rationales: y\n### The final answer is: 3\n### Step 1: z\n"
      "### The final answer is: 5")
T4 = "### Image Description: x\n### Rationales: y\n### Step 1: z\n### Step 3: w\n### The final answer is: 5"
T5 = T3[: -len(" 5")]  # ends with a bare final-answer header


def reward(name, **options):
    cls = registry.get("reward", name)
    return cls(cls.Config(**options))


def rar(texts, key_steps, **options):
    batch = PromptBatch(["q"] * len(texts), metadata=[{"key_steps": key_steps} for _ in texts])
    return reward("step_rar", **options)({"texts": texts}, batch)


def rvr(texts, **options):
    return reward("step_rvr", **options)({"texts": texts}, PromptBatch(["q"] * len(texts)))


def test_step_rar_worked_example():
    # only "3^2 + 4^2" is in the steps' text ("c=5" is not "c = 5"; "pythagorean" is in the rationale only)
    assert rar([T1], STEPS).scores.tolist() == [0.25]
    accuracy_reward = 1.0 + 0.1 * rar([T1], STEPS).scores  # R1-VL's accuracy reward of a correct answer
    assert accuracy_reward.tolist() == [pytest.approx(1.025)]
    assert rar([T1], STEPS, scope="all", squeeze_whitespace=True).scores.tolist() == [0.75]  # mmgrpo's variants
    think = rar([T1], STEPS, scope="think", squeeze_whitespace=True)
    assert think.scores.tolist() == [0.0] and think.components["no_reasoning"].tolist() == [1.0]


def test_step_rvr_worked_examples():
    texts = [T1, T2, T3, T4, T5]
    assert rvr(texts).scores.tolist() == [1, 1, 0, 0, 1]  # R1-VL
    assert rvr(texts, part_order=True, answer_check="last").scores.tolist() == [1, 0, 1, 0, 1]  # the stricter rules
    assert rvr([T2], part_order=True).scores.tolist() == [0] and rvr([T3], answer_check="last").scores.tolist() == [1]


def r1_vl_step_rar(text: str, key_steps: list) -> float:
    """R1-VL's StepRAR written from its rule with regular expressions."""
    sections = re.findall(r"### Step \d+:\s*(.*?)(?=\n###|\Z)", text, re.DOTALL)
    body = " ".join(sections).lower()
    alternatives = [[s] if isinstance(s, str) else s for s in key_steps]
    return sum(any(a.lower() in body for a in alts) for alts in alternatives) / len(alternatives)


def r1_vl_step_rvr(text: str) -> float:
    """R1-VL's StepRVR written from its rule with regular expressions."""
    headers = ["### Image Description:", "### Rationales:", "### Step 1:", "### The final answer is:"]
    if not all(h in text for h in headers):
        return 0.0
    steps = list(re.finditer(r"### Step (\d+):", text))
    if not text.strip().endswith(headers[3]) and text.index(headers[3]) < steps[-1].end():
        return 0.0
    return float([int(m.group(1)) for m in steps] == list(range(1, len(steps) + 1)))


PIECES = ["### Step ", "### Step 1:", "### Step 2:", "### Step 3:", "### Step 01:", "### Step ١:", "\n", " ", "\n###",
          "### Image Description:", "### Rationales:", "### The final answer is:", "### The final answer is: 7",
          "c = 5", "c=5", "X", "x", "3^2", "#", ":", "1", "2", "Step"]
TEXT = st.lists(st.sampled_from(PIECES), max_size=30).map("".join)
KEY_STEPS = st.lists(st.one_of(st.sampled_from(["c = 5", "c=5", "x", "X 1", "3^2", "step", " 1", "\n#"]),
                               st.lists(st.sampled_from(["x", "c = 5", "2", "y"]), min_size=1, max_size=3)),
                     min_size=1, max_size=5)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(st.lists(TEXT, min_size=1, max_size=4), KEY_STEPS)
def test_defaults_equal_r1_vl_rules_on_generated_texts(texts, key_steps):
    expected = torch.tensor([r1_vl_step_rar(t, key_steps) for t in texts])
    torch.testing.assert_close(rar(texts, key_steps).scores, expected, rtol=0, atol=1e-7)
    assert rvr(texts).scores.tolist() == [r1_vl_step_rvr(t) for t in texts]


def test_long_step_texts_are_read_in_linear_time():
    """Many empty or repeated step headers (each empty header takes the next line, as R1-VL's pattern does)."""
    texts = ["### Step 1:\n" * 100_000, "### Step 1:" * 100_000, "### Step " * 100_000 + "1:"]
    out = rar(texts, ["### step 1:", "x"], max_completion_chars=0)
    assert out.scores.tolist() == [0.5, 0.5, 0.0] == [r1_vl_step_rar(t, ["### step 1:", "x"]) for t in texts]
    assert rvr(texts, max_completion_chars=0).components["steps"].tolist() == [100_000, 100_000, 1]
