"""The segmentation recipe inside the one trainer: a tiny Qwen2.5-VL text policy, referring JSONL rows, Seg-Zero's
terms and the SAM 2 segmenter reward in a composite; a step and an evaluation complete, the evaluation reports gIoU
and cIoU parts, and writes the overlays."""

import json
from pathlib import Path

import pytest

from builders._sam import tiny_sam2_dir  # noqa: F401
from mmgrpo import config as config_mod
from mmgrpo.trainer import Trainer

EXAMPLE = Path(__file__).resolve().parents[2] / "data" / "examples" / "seg" / "referring.jsonl"


def test_segmentation_step_and_evaluation_with_overlays(tmp_path, tiny_qwen2_5_vl_dir, tiny_sam2_dir):
    raw = {
        "output_dir": str(tmp_path / "run"),
        "seed": 0,
        "pipeline": {"name": "qwen_vl", "pretrained": tiny_qwen2_5_vl_dir, "max_new_tokens": 6, "lora_rank": 4,
                     "lora_alpha": 8},
        "algorithm": {"name": "grpo", "kl_beta": 0.0},
        "reward": {"name": "composite", "rewards": {
            "seg_zero": {"coords": "resized"},
            "sam": {"name": "sam_mask", "model": tiny_sam2_dir, "device": "cpu", "coords": "resized"}}},
        "data": {"name": "referring_jsonl", "train_file": str(EXAMPLE), "eval_file": str(EXAMPLE)},
        "train": {"max_steps": 1, "prompts_per_step": 2, "group_size": 2, "minibatch_size": 2, "learning_rate": 1e-3},
        "eval": {"every": 1, "num_prompts": 3, "metric": "sam/iou", "grid_size": 3},
        "checkpoint": {"every": 0, "keep_last": 1},
    }
    trainer = Trainer(config_mod.from_dict(raw))
    metrics = trainer.train_step()
    assert "reward/sam/iou" in metrics and "reward/seg_zero/think_format" in metrics
    assert any(item["metadata"].get("input_size") for item in trainer.stream.items)  # the resized frame, written
    scores = trainer.evaluate(1)
    # a random tiny policy writes no box: empty masks, IoU 0, and the union is the truth's area
    assert scores["eval/sam/iou"] == 0.0 and scores["eval/sam/no_box"] == 1.0
    truth_area = sum(int(item["metadata"]["mask"].sum()) for item in trainer.eval_items["eval"][:3]) / 3
    assert scores["eval/sam/union"] == pytest.approx(truth_area) and scores["eval/sam/intersection"] == 0.0
    samples = tmp_path / "run" / "samples"
    assert (samples / "step_00001_seg.png").is_file()
    page = (samples / "step_00001_seg.html").read_text()
    rows = [json.loads(line) for line in (samples / "step_00001.jsonl").read_text().splitlines()]
    assert page.count("<img") == 3 and len(rows) == 3
