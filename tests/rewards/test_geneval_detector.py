"""geneval_detector: GenEval's rule (thresholds, per-class limit, NMS, counting through `exclude`, colour, position)
on hand-made detections with hand-computed relations, and the model path on a tiny random OWL-ViT and a tiny
open_clip saved and reloaded, compared with the processor on PIL images, the detector's own post-processing, and
GenEval's zero-shot colour classifier written out."""

import math

import open_clip
import pytest
import torch
from PIL import Image

from mmgrpo.rewards._geneval_rule import COLORS, check_metadata, evaluate, relative_position, select
from mmgrpo.rewards.geneval_detector import COLOR_TEMPLATES, GenevalDetector
from mmgrpo.types import PromptBatch
from mmgrpo.validation import ConfigError
from reward_fixtures import tiny_clip_dir, tiny_owlvit_dir, write_tiny_owl  # noqa: F401 (fixtures)


def test_relative_position_by_hand():
    # centres (5, 5) and (25, 5): offset (-20, 0), shrunk by 0.1 * (10 + 10) = 2 -> (-18, 0) / 20 = -0.9
    assert relative_position((0, 0, 10, 10), (20, 0, 30, 10), 0.1) == {"left of"}
    assert relative_position((20, 0, 30, 10), (0, 0, 10, 10), 0.1) == {"right of"}
    # offset (-12, -12) -> (-10, -10) / (12 * sqrt 2) = -0.589 on both axes
    assert -10 / (12 * math.sqrt(2)) < -0.5
    assert relative_position((0, 0, 10, 10), (12, 12, 22, 22), 0.1) == {"left of", "above"}
    assert relative_position((0, 30, 10, 40), (0, 0, 10, 10), 0.1) == {"below"}
    assert relative_position((0, 0, 10, 10), (1, 1, 11, 11), 0.1) == set()  # shrunk to nothing
    # offset (-12, 4): x -> -10 / 12.65 = -0.79, y -> 2 / 12.65 = 0.16: left only
    assert relative_position((0, 4, 10, 14), (12, 0, 22, 10), 0.1) == {"left of"}


def test_select_thresholds_limits_and_nms():
    boxes = [((0, 0, 10, 10), 0.95), ((1, 1, 11, 11), 0.5), ((50, 50, 60, 60), 0.31), ((0, 0, 5, 5), 0.3)]
    assert select(boxes, 0.3, 16, 1.0) == boxes[:3]  # above the threshold, not at it; no NMS
    assert select(boxes, 0.9, 16, 1.0) == boxes[:1]
    assert select(boxes, 0.3, 2, 1.0) == boxes[:2]
    # IoU of the first two: 100 / (121 + 121 - 100) = 0.704 with GenEval's inclusive widths
    assert select(boxes, 0.3, 16, 0.7) == [boxes[0], boxes[2]]
    assert select(boxes, 0.3, 16, 0.71) == boxes[:3]
    assert select(list(reversed(boxes)), 0.3, 16, 1.0) == boxes[:3]  # most confident first


def never(name, boxes):
    raise AssertionError("no colour clause")


def test_counting_is_include_and_exclude():
    metadata = {"tag": "counting", "include": [{"class": "cat", "count": 2}], "exclude": [{"class": "cat", "count": 3}]}
    cats = [((i * 20, 0, i * 20 + 10, 10), 0.95) for i in range(3)]
    assert evaluate({"cat": cats[:2]}, metadata, never) == (True, 2, 2)
    assert evaluate({"cat": cats}, metadata, never) == (False, 1, 2)
    assert evaluate({"cat": cats[:1]}, metadata, never) == (False, 1, 2)
    assert evaluate({}, metadata, never) == (False, 1, 2)


def test_colour_uses_the_most_confident_count_boxes():
    metadata = {"tag": "colors", "include": [{"class": "car", "count": 1, "color": "red"}]}
    cars = [((0, 0, 10, 10), 0.9), ((20, 0, 30, 10), 0.8)]
    seen = []

    def colour_of(name, boxes):
        seen.append((name, boxes))
        return ["blue"] * len(boxes)

    assert evaluate({"car": cars}, metadata, colour_of) == (False, 0, 1)
    assert seen == [("car", [(0, 0, 10, 10)])]
    assert evaluate({"car": cars}, metadata, lambda n, b: ["red"]) == (True, 1, 1)


def test_position_against_every_matched_target():
    metadata = {"tag": "position", "include": [{"class": "tv", "count": 1},
                                               {"class": "clock", "count": 1, "position": ["below", 0]}]}
    tv, clock_below, clock_left = ((0, 0, 10, 10), 0.9), ((0, 30, 10, 40), 0.9), ((-30, 0, -20, 10), 0.9)
    assert evaluate({"tv": [tv], "clock": [clock_below]}, metadata, never) == (True, 2, 2)
    assert evaluate({"tv": [tv], "clock": [clock_left]}, metadata, never) == (False, 1, 2)
    assert evaluate({"clock": [clock_below]}, metadata, never) == (False, 0, 2)  # no target: the relation fails


def test_metadata_that_the_rule_cannot_read():
    good = {"tag": "position", "include": [{"class": "tv", "count": 1},
                                           {"class": "clock", "count": 1, "position": ["below", 0]}]}
    assert check_metadata(good)
    assert not check_metadata({})
    assert not check_metadata({"include": [{"class": "tv", "count": 0}]})
    assert not check_metadata({"include": [{"class": "tv", "count": 1, "color": "teal"}]})
    assert not check_metadata({"include": [{"class": "tv", "count": 1, "position": ["below", 0]}]})
    assert not check_metadata({"include": [{"class": "tv", "count": True}]})


@pytest.fixture(scope="module")
def reward(tiny_owlvit_dir, tiny_clip_dir):
    return GenevalDetector(GenevalDetector.Config(detector=tiny_owlvit_dir, clip_model_name=f"local-dir:{tiny_clip_dir}",
                                                  device="cpu", threshold=0.2, counting_threshold=0.45))


def pil_batch(n=2, size=(40, 56)):
    pixels = (torch.rand(n, 3, *size, generator=torch.Generator().manual_seed(0)) * 255).round() / 255
    return pixels, [Image.fromarray((p.permute(1, 2, 0) * 255).round().byte().numpy()) for p in pixels]


def test_detections_equal_the_processor_and_post_processing(reward, tiny_owlvit_dir):
    from transformers import OwlViTForObjectDetection, OwlViTProcessor

    pixels, pil = pil_batch()
    processor = OwlViTProcessor.from_pretrained(tiny_owlvit_dir)
    model = OwlViTForObjectDetection.from_pretrained(tiny_owlvit_dir).eval()
    with torch.no_grad():
        inputs = processor(text=[reward.queries] * 2, images=pil, return_tensors="pt")
        results = processor.post_process_grounded_object_detection(model(**inputs), threshold=0.2,
                                                                   target_sizes=[(40, 56)] * 2)
    found = reward.detect(pixels)
    assert sum(len(f) for f in found) > 0  # the tiny detector finds something above 0.2
    for ours, theirs in zip(found, results):
        assert [name for name, _, _ in ours] == [reward.queries[int(k)][len("a photo of a "):] for k in theirs["labels"]]
        torch.testing.assert_close(torch.tensor([box for _, box, _ in ours]), theirs["boxes"])
        torch.testing.assert_close(torch.tensor([score for _, _, score in ours]), theirs["scores"])


def test_owlv2_boxes_are_in_the_padded_square_frame(tmp_path, tiny_clip_dir):
    """OWLv2 pads an image to a square (bottom and right) before resizing, so its post-processing scales boxes by the
    longer side: the boxes equal the processor's own on a square-padded target size."""
    from transformers import Owlv2ForObjectDetection, Owlv2Processor

    folder = write_tiny_owl(tmp_path, version=2)
    reward = GenevalDetector(GenevalDetector.Config(detector=folder, clip_model_name=f"local-dir:{tiny_clip_dir}",
                                                    device="cpu", threshold=0.2))
    pixels, pil = pil_batch()
    processor, model = Owlv2Processor.from_pretrained(folder), Owlv2ForObjectDetection.from_pretrained(folder).eval()
    with torch.no_grad():
        inputs = processor(text=[reward.queries] * 2, images=pil, return_tensors="pt")
        results = processor.post_process_grounded_object_detection(model(**inputs), threshold=0.2,
                                                                   target_sizes=[(56, 56)] * 2)
    found = reward.detect(pixels)
    assert sum(len(f) for f in found) > 0
    for ours, theirs in zip(found, results):
        torch.testing.assert_close(torch.tensor([box for _, box, _ in ours]), theirs["boxes"])
        torch.testing.assert_close(torch.tensor([score for _, _, score in ours]), theirs["scores"])


def test_colours_are_genevals_zero_shot_classifier(reward, tiny_clip_dir):
    pixels, pil = pil_batch()
    boxes = [(0, 0, 32, 32), (24, 8, 56, 40)]  # crops of the CLIP's own size: its transform only normalises
    model = open_clip.create_model(f"local-dir:{tiny_clip_dir}").eval()
    _, _, preprocess = open_clip.create_model_and_transforms(f"local-dir:{tiny_clip_dir}")
    tokenizer = open_clip.get_tokenizer(f"local-dir:{tiny_clip_dir}")
    with torch.no_grad():
        weights = []
        for c in COLORS:  # clip_benchmark's zero_shot_classifier: mean of normalised template embeddings, normalised
            e = torch.nn.functional.normalize(model.encode_text(tokenizer([t.format(c=c, name="car") for t in COLOR_TEMPLATES])), dim=-1)
            weights.append(torch.nn.functional.normalize(e.mean(0), dim=0))
        crops = torch.stack([preprocess(pil[0].crop(b)) for b in boxes])
        logits = torch.nn.functional.normalize(model.encode_image(crops), dim=-1) @ torch.stack(weights).T
    assert reward.colours(pixels[0], "car", boxes) == [COLORS[int(k)] for k in logits.argmax(1)]


def test_scores_are_the_rule_on_the_detections(reward):
    pixels, _ = pil_batch(3)
    found = reward.detect(pixels)
    metadata = [{"tag": "two_object", "include": [{"class": name, "count": 1} for name in {n for n, _, _ in found[0]}][:2]},
                {"tag": "counting", "include": [{"class": "cat", "count": 2}], "exclude": [{"class": "cat", "count": 3}]},
                {"tag": "colors", "include": [{"class": found[2][0][0] if found[2] else "cat", "count": 1, "color": "red"}]}]
    result = reward({"images": pixels}, PromptBatch(["p"] * 3, metadata=metadata))
    for i, m in enumerate(metadata):
        threshold = 0.45 if m["tag"] == "counting" else 0.2
        per_class = {}
        for name, box, score in found[i]:
            if score > threshold:
                per_class.setdefault(name, []).append((box, score))
        per_class = {k: sorted(v, key=lambda d: -d[1])[:16] for k, v in per_class.items()}
        correct, passed, total = evaluate(per_class, m, lambda name, boxes: reward.colours(pixels[i], name, boxes))
        assert result.components["strict"][i] == float(correct)
        assert result.components["partial"][i] == pytest.approx(passed / total)
    assert result.scores.tolist() == result.components["partial"].tolist()
    assert result.components["partial"][0] == 1.0  # the classes it found
    unknown = reward({"images": pixels[:2]}, PromptBatch(["p"] * 2, metadata=[{}, {"include": [{"class": "unicorn", "count": 1}]}]))
    assert unknown.scores.isnan().all()


def test_options_are_checked(tmp_path, tiny_owlvit_dir):
    with pytest.raises(ConfigError, match="geneval_detector.threshold"):
        GenevalDetector.Config(detector=tiny_owlvit_dir, threshold=1.0)
    with pytest.raises(ConfigError, match="query_template"):
        GenevalDetector.Config(detector=tiny_owlvit_dir, query_template="a photo of a {class}")
    with pytest.raises(ConfigError, match="geneval_detector.max_overlap"):
        GenevalDetector.Config(detector=tiny_owlvit_dir, max_overlap=0.0)
    with pytest.raises(ValueError, match="geneval_detector.detector"):
        GenevalDetector.Config(detector=str(tmp_path / "missing"))
