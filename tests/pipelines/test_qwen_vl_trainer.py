"""The one trainer loop, unchanged, on a tiny Qwen2-VL with image prompts from JSONL: counting (format + accuracy)
and grounding (box IoU through the resized frame), every token algorithm, group size 2."""

import html
import json
from pathlib import Path

import pytest

from mmgrpo import config as config_mod
from mmgrpo.trainer import Trainer

EXAMPLES = Path(__file__).resolve().parents[2] / "data" / "examples" / "vlm"


def make_config(tmp_path, model_dir, algorithm="grpo", task="count", **algorithm_options):
    reward = ({"name": "composite", "rewards": {"format": {"weight": 0.5}, "accuracy": {"mode": "numeric"}}}
              if task == "count" else {"name": "box_iou", "coords": "resized"})
    return {
        "output_dir": str(tmp_path / "run"),
        "seed": 0,
        "pipeline": {"name": "qwen_vl", "pretrained": model_dir, "max_new_tokens": 6, "lora_rank": 4, "lora_alpha": 8},
        "algorithm": {"name": algorithm, **algorithm_options},
        "reward": reward,
        "data": {"name": "vlm_jsonl", "train_file": str(EXAMPLES / f"{task if task == 'count' else 'grounding'}.jsonl"),
                 "eval_file": str(EXAMPLES / f"{task if task == 'count' else 'grounding'}.jsonl")},
        "train": {"max_steps": 2, "prompts_per_step": 2, "group_size": 2, "minibatch_size": 2, "learning_rate": 1e-3},
        "eval": {"every": 2, "num_prompts": 2, "metric": "accuracy" if task == "count" else "score"},
        "checkpoint": {"every": 0, "keep_last": 1},
    }


@pytest.mark.parametrize("algorithm", ["grpo", "dr_grpo", "dapo", "gspo", "sapo"])
def test_trainer_runs_token_algorithms_on_qwen_vl(tmp_path, tiny_qwen2_vl_dir, algorithm):
    raw = make_config(tmp_path, tiny_qwen2_vl_dir, algorithm)
    summary = Trainer(config_mod.from_dict(raw)).train()
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert summary["steps"] == 2 and [r["step"] for r in records if "reward/mean" in r] == [1, 2]
    assert any("eval/accuracy" in r for r in records)
    lengths = [r["eval/completion_tokens"] for r in records if "eval/accuracy" in r]  # mean completion length
    assert lengths and all(1.0 <= n <= 6.0 for n in lengths)  # max_new_tokens 6, the end of turn included
    for r in records:
        if "train/ratio_mean" in r:  # one update per rollout: on-policy
            assert r["train/ratio_mean"] == pytest.approx(1.0, abs=1e-4)
    assert (tmp_path / "run" / "checkpoints").is_dir()
    if algorithm == "grpo":  # the sample table: input image, prompt, completion and reward per held-out question
        page = (tmp_path / "run" / "samples" / "step_00002.html").read_text()
        first = json.loads((tmp_path / "run" / "samples" / "step_00002.jsonl").read_text().splitlines()[0])
        assert page.count("<img src=\"data:image/png;base64,") >= 2 and page.count("<tr>") >= 3
        assert html.escape(first["text"]) in page


def test_grounding_rewards_malformed_boxes_without_crashing(tmp_path, tiny_qwen2_5_vl_dir):
    """A random tiny model writes no box: box_iou scores 0 with malformed = 1 (its documented rule), and the step and
    the evaluation complete; the pipeline supplies the resized frame (`input_size`) the reward maps boxes from."""
    raw = make_config(tmp_path, tiny_qwen2_5_vl_dir, "grpo", task="grounding", kl_beta=0.0)
    trainer = Trainer(config_mod.from_dict(raw))
    metrics = trainer.train_step()
    assert metrics["reward/mean"] == 0.0 and metrics["reward/malformed"] == 1.0
    assert metrics["train/skipped_updates"] == 1  # every advantage is 0: no update
    items = trainer.stream.items
    assert all(item["metadata"]["image_size"] == [96, 64] for item in items)
    assert any(item["metadata"].get("input_size") for item in items)  # written by the pipeline at sampling
    assert trainer.evaluate(0)["eval/score"] == 0.0
