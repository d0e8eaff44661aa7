"""``coords: model``: the grounding and segmentation rewards read each sample's box frame from the pipeline's
declaration (``metadata["coords"]``, written by `qwen_vl` from the checkpoint's family), not from the config: a box
the model writes in its family's frame maps to the same original-image box for every convention."""

import dataclasses

import pytest

from mmgrpo.pipelines._qwen_vl_config import FAMILIES
from mmgrpo.rewards._seg_parse import parse_prompt
from mmgrpo.rewards.box_iou import BoxIoU, BoxIoUConfig
from mmgrpo.rewards.seg_zero import SegZero, SegZeroConfig
from mmgrpo.types import PromptBatch

TRUE_BOX = [40.0, 20.0, 120.0, 60.0]  # original-image pixels
IMAGE_SIZE, INPUT_SIZE = [200, 100], [448, 224]  # the original image, the resized model input (Qwen2.5-VL)


def written(frame: str) -> list[float]:
    """`TRUE_BOX` as a model of convention `frame` writes it: resized-input pixels or 0-1000 relative."""
    if frame == "resized":
        scale = [INPUT_SIZE[0] / IMAGE_SIZE[0], INPUT_SIZE[1] / IMAGE_SIZE[1]] * 2
    else:
        scale = [1000 / IMAGE_SIZE[0], 1000 / IMAGE_SIZE[1]] * 2
    return [x * s for x, s in zip(TRUE_BOX, scale)]


def metadata(frame: str) -> dict:
    return {"boxes": [TRUE_BOX], "image_size": IMAGE_SIZE, "input_size": INPUT_SIZE, "coords": frame}


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_box_iou_reads_each_familys_declared_frame(model_type):
    """Each family's box, written in its own frame, scores IoU 1 under ``coords: model``; the configured frame of
    the other convention would miss it."""
    frame = FAMILIES[model_type].box_frame
    text = "<answer>[{}, {}, {}, {}]</answer>".format(*written(frame))
    reward = BoxIoU(BoxIoUConfig(coords="model"))
    result = reward({"texts": [text]}, PromptBatch(["where?"], metadata=[metadata(frame)]))
    assert result.scores.item() == pytest.approx(1.0)
    other = "norm1000" if frame == "resized" else "resized"
    wrong = BoxIoU(BoxIoUConfig(coords=other))({"texts": [text]}, PromptBatch(["where?"], metadata=[metadata(frame)]))
    assert wrong.scores.item() < 0.5


def test_the_declared_frames_are_the_two_conventions():
    """Qwen2.5-VL answers in pixels of its resized input; Qwen2-VL, Qwen3-VL and Qwen3.5 in 0-1000 relative."""
    frames = {name: family.box_frame for name, family in FAMILIES.items()}
    assert frames["qwen2_5_vl"] == "resized"
    assert {frames[n] for n in ("qwen2_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe")} == {"norm1000"}


@pytest.mark.parametrize("frame", ["resized", "norm1000"])
def test_segmentation_prompts_map_boxes_and_points_from_the_declared_frame(frame):
    box = written(frame)
    point = [(box[0] + box[2]) / 2, (box[1] + box[3]) / 2]
    text = f'<answer>{{"bbox": {box}, "points_1": {point}, "points_2": {point}}}</answer>'
    prompt = parse_prompt(text, "seg_zero", BoxIoU(BoxIoUConfig(coords="model")), metadata(frame))
    assert prompt.boxes[0] == pytest.approx(TRUE_BOX)
    assert prompt.points[0][0] == pytest.approx([80.0, 40.0])
    terms = SegZero(SegZeroConfig(coords="model"))({"texts": [f"<think>a</think>{text}"]},
                                                   PromptBatch(["segment"], metadata=[metadata(frame)]))
    assert terms.components["box_iou"].item() == 1.0 and terms.components["box_l1"].item() == 1.0


@pytest.mark.parametrize("value", [None, "pixels"])
def test_model_frame_without_a_declaration_is_a_clear_error(value):
    meta = metadata("resized")
    meta.pop("coords") if value is None else meta.update(coords=value)
    with pytest.raises(ValueError, match=r"coords='model' reads the frame the pipeline declares.*metadata\['coords'\]"):
        BoxIoU(BoxIoUConfig(coords="model"))({"texts": ["[1, 2, 3, 4]"]}, PromptBatch(["q"], metadata=[meta]))


def test_the_frame_comes_from_the_model_by_default():
    """Without a `coords` option the grounding and segmentation rewards read the pipeline's declared frame; a sample
    without one is refused in one line naming the fixed frames; a fixed frame still overrides the declaration."""
    from mmgrpo.rewards.sam_mask import SamMaskConfig

    assert BoxIoUConfig().coords == SegZeroConfig().coords == "model"
    assert {f.name: f.default for f in dataclasses.fields(SamMaskConfig)}["coords"] == "model"
    for frame in ("resized", "norm1000"):
        text = "<answer>[{}, {}, {}, {}]</answer>".format(*written(frame))
        result = BoxIoU(BoxIoUConfig())({"texts": [text]}, PromptBatch(["where?"], metadata=[metadata(frame)]))
        assert result.scores.item() == pytest.approx(1.0)
    undeclared = {k: v for k, v in metadata("resized").items() if k != "coords"}
    text = "<answer>[{}, {}, {}, {}]</answer>".format(*written("resized"))
    with pytest.raises(ValueError, match=r"^box_iou: coords='model' .* got None for sample 0: this pipeline declares "
                                         r"none; set the reward's coords to the frame the model writes in \('resized', "
                                         r"'original', 'norm1000' or 'norm1'\)\.$"):
        BoxIoU(BoxIoUConfig())({"texts": [text]}, PromptBatch(["where?"], metadata=[undeclared]))
    fixed = BoxIoU(BoxIoUConfig(coords="resized"))({"texts": [text]}, PromptBatch(["where?"], metadata=[undeclared]))
    assert fixed.scores.item() == pytest.approx(1.0)
    declared_other = BoxIoU(BoxIoUConfig(coords="norm1000"))({"texts": [text]},
                                                               PromptBatch(["where?"], metadata=[metadata("resized")]))
    assert declared_other.scores.item() < 0.5  # an explicit frame wins over the declaration


def test_the_qwen_vl_grounding_configs_read_the_frame_from_the_model(monkeypatch):
    from pathlib import Path

    from mmgrpo import config as config_mod

    root = Path(__file__).resolve().parents[2]
    monkeypatch.chdir(root)
    for name, reward in (("qwen2_5_vl_3b_grpo_grounding", "box_iou"), ("qwen2_5_vl_3b_seg_zero", "seg_zero")):
        cfg = config_mod.load(root / "configs" / f"{name}.yaml")
        assert "coords" not in cfg.reward.options.rewards[reward], name  # the default: the model's frame
