"""ocr: the Flow-GRPO rule (quoted target, spaces removed, lowercased, containment, Levenshtein capped at the target's
length) against hand-computed values and a full-matrix Levenshtein, its cost bounds on 1 MB texts, and the model path
on a tiny random TrOCR saved and reloaded, compared with the processor on PIL images and greedy generation."""

import time

import pytest
import torch
from hypothesis import given, settings, strategies as st
from PIL import Image

from mmgrpo.rewards.ocr import Ocr, edit_distance, ocr_score, quoted_text
from mmgrpo.types import PromptBatch
from mmgrpo.validation import ConfigError
from reward_fixtures import tiny_trocr_dir  # noqa: F401 (fixture)


def levenshtein(a: str, b: str) -> int:
    """The textbook full-matrix Levenshtein distance (unit costs)."""
    table = [[i + j if i * j == 0 else 0 for j in range(len(b) + 1)] for i in range(len(a) + 1)]
    for i in range(1, len(a) + 1):
        for j in range(1, len(b) + 1):
            table[i][j] = min(table[i - 1][j] + 1, table[i][j - 1] + 1, table[i - 1][j - 1] + (a[i - 1] != b[j - 1]))
    return table[len(a)][len(b)]


def test_quoted_text_is_the_authors_split():
    for prompt in ['a sign that says "Open Late" at night', 'x "abc', 'no quote', 'say ""', '"a" and "b"']:
        expected = prompt.split('"')[1] if '"' in prompt else None
        assert quoted_text(prompt) == expected


@pytest.mark.parametrize("read, target, expected", [
    ("HELLO world!", "hello world", 1.0),  # contained after removing spaces and lowercasing
    ("hell", "hello", 1 - 1 / 5),  # one insertion
    ("abdc", "abcd", 1 - 2 / 4),  # a transposition costs two edits
    ("kitten", "sitting", 1 - 3 / 7),
    ("", "abc", 0.0),  # nothing read: the distance is the target's length
    ("xyzxyzxyzxyz", "abc", 0.0),  # many unrelated characters: capped at the target's length, never below 0
    ("Open Late 24h", "open late", 1.0),
])
def test_ocr_score_by_hand(read, target, expected):
    assert ocr_score(read, target, max_chars=256) == pytest.approx(expected)


def test_empty_target_is_nan():
    assert ocr_score("anything", "   ", max_chars=256) != ocr_score("anything", "   ", max_chars=256)


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet="abc", max_size=12), st.text(alphabet="abc", max_size=12), st.integers(1, 15))
def test_edit_distance_is_the_capped_levenshtein(a, b, cap):
    assert edit_distance(a, b, cap) == min(levenshtein(a, b), cap)
    assert edit_distance(a, b, cap) == edit_distance(b, a, cap)


@settings(max_examples=100, deadline=None)
@given(st.text(alphabet="aB c", max_size=16), st.text(alphabet="aB c", min_size=1, max_size=8))
def test_ocr_score_is_the_authors_formula(read, target):
    r, t = read.replace(" ", "").lower(), target.replace(" ", "").lower()
    if not t:
        return
    d = 0 if t in r else min(levenshtein(r, t), len(t))
    assert ocr_score(read, target, max_chars=256) == pytest.approx(1 - d / len(t))


def test_megabyte_texts_cost_a_bounded_time():
    start = time.perf_counter()
    assert edit_distance("a" * 2**20, "b" * 40, 40) == 40  # the length difference alone reaches the cap
    assert 0.0 <= ocr_score("ab" * 2**19, "ba" * 2**19, max_chars=256) <= 1.0  # both cut to 256 characters
    assert ocr_score("x" * 2**20, "a" * 2**20, max_chars=256) == 0.0
    assert time.perf_counter() - start < 10.0  # ~0.1 s here; the uncut texts would take hours


def test_model_path_equals_processor_and_greedy_generation(tiny_trocr_dir):
    from transformers import TrOCRProcessor, VisionEncoderDecoderModel

    reward = Ocr(Ocr.Config(model=tiny_trocr_dir, device="cpu", max_new_tokens=8))
    pixels = torch.rand(3, 3, 40, 56, generator=torch.Generator().manual_seed(0))
    pixels = (pixels * 255).round() / 255
    processor = TrOCRProcessor.from_pretrained(tiny_trocr_dir)
    model = VisionEncoderDecoderModel.from_pretrained(tiny_trocr_dir).eval()
    pil = [Image.fromarray((p.permute(1, 2, 0) * 255).round().byte().numpy()) for p in pixels]
    with torch.no_grad():
        ids = model.generate(processor(images=pil, return_tensors="pt").pixel_values, max_new_tokens=8, num_beams=1,
                             do_sample=False)
    read = processor.batch_decode(ids, skip_special_tokens=True)
    assert reward.read(pixels) == read
    # targets built from what was read: contained, one character off, unrelated; and a prompt without a quote
    assert all(len(r.replace(" ", "")) >= 6 for r in read)  # the fixture's model reads characters
    targets = [read[0][:3], read[1][:-1] + "q", "zzz"]
    prompts = [f'a sign that says "{t}"' for t in targets[:2]] + ['zzz "zzz"']
    result = reward({"images": pixels}, PromptBatch(prompts))
    expected = []
    for r, t in zip(read, targets):
        r, t = r.replace(" ", "").lower(), t.replace(" ", "").lower()
        expected.append(1 - (0 if t in r else min(levenshtein(r, t), len(t))) / len(t))
    torch.testing.assert_close(result.scores, torch.tensor(expected))
    assert result.components["exact"].tolist() == [float(e == 1.0) for e in expected]
    unquoted = reward({"images": pixels}, PromptBatch(["no quote", prompts[1], 'empty ""']))
    assert unquoted.scores[0].isnan() and unquoted.scores[2].isnan() and unquoted.scores[1] == result.scores[1]


def test_ocr_options_are_checked(tmp_path):
    with pytest.raises(ConfigError, match="ocr.max_chars"):
        Ocr.Config(model=str(tmp_path), max_chars=0)
    with pytest.raises(ConfigError, match="ocr.max_new_tokens"):
        Ocr.Config(model=str(tmp_path), max_new_tokens=10**6)
    with pytest.raises(ValueError, match="ocr.model"):
        Ocr.Config(model=str(tmp_path / "missing"))
