"""Evaluation of every held-out split a prompt source declares (`mmgrpo.evaluation.evaluate_splits`): a tiny Qwen2-VL
trained one step on `vlm_shapes` with ``ood: true`` logs ``eval/<metric>`` for the ``eval`` split and
``eval/ood/<metric>`` for the ``ood`` split, in metrics.jsonl, TensorBoard and per-prompt files; ``eval.splits`` picks
splits and is checked before any model loads; `mmgrpo sft` reports the same splits."""

import json
from pathlib import Path

import pytest

from mmgrpo import config as config_mod
from mmgrpo.config import ConfigError
from mmgrpo.preflight import preflight
from mmgrpo.sft import SFTTrainer
from mmgrpo.trainer import Trainer


def raw_config(tmp_path, model_dir, **eval_options):
    return {
        "output_dir": str(tmp_path / "run"), "seed": 0,
        "pipeline": {"name": "qwen_vl", "pretrained": model_dir, "max_new_tokens": 4, "min_pixels": 3136,
                     "max_pixels": 3136, "lora_rank": 0},
        "algorithm": {"name": "grpo"},
        "reward": {"name": "composite", "rewards": {"accuracy": {"mode": "numeric"}, "format": {"weight": 0.1}}},
        "data": {"name": "vlm_shapes", "n_train": 4, "n_eval": 3, "max_objects": 3, "ood": True,
                 "with_targets": True},
        "train": {"max_steps": 1, "prompts_per_step": 2, "group_size": 2, "minibatch_size": 4,
                  "learning_rate": 1e-4},
        "eval": {"every": 1, "num_prompts": 3, "grid_size": 2, "metric": "accuracy", **eval_options},
        "checkpoint": {"every": 0, "keep_last": 1},
    }


def test_training_logs_every_declared_split_under_its_own_names(tmp_path, tiny_qwen2_vl_dir):
    trainer = Trainer(config_mod.from_dict(raw_config(tmp_path, tiny_qwen2_vl_dir)))
    assert list(trainer.eval_items) == ["eval", "ood"]
    trainer.train()
    run = tmp_path / "run"
    evals = [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "eval/score" in r]
    assert [r["step"] for r in evals] == [0, 1]
    for record in evals:
        assert {"eval/accuracy", "eval/ood/score", "eval/ood/accuracy", "eval/ood/completion_tokens"} <= set(record)
        assert not any(key.startswith("eval/eval/") for key in record)
    # each split's per-prompt file: its prompts (the ood split's scenes), and its mean is the logged metric
    for split, folder in (("eval/", run / "eval"), ("eval/ood/", run / "eval" / "ood")):
        rows = json.loads((folder / "step_00001.json").read_text())
        assert sum(r["n"] for r in rows) == 3
        assert sum(r["n"] * r["accuracy"] for r in rows) / 3 == pytest.approx(evals[-1][split + "accuracy"])
    assert (run / "samples" / "ood" / "step_00001.jsonl").is_file() and (run / "samples" / "step_00001.jsonl").is_file()
    tags = [tag for events in (run / "tensorboard").rglob("events.*") for tag in _scalar_tags(events.parent)]
    assert any("ood" in tag and "accuracy" in tag for tag in tags), tags


def _scalar_tags(folder: Path) -> list[str]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder), size_guidance={"scalars": 0})
    events.Reload()
    return events.Tags()["scalars"]


def test_an_ood_split_scores_as_its_items_would_as_the_eval_split(tmp_path, tiny_qwen2_vl_dir):
    """The split's metrics are an ordinary evaluation of its items (same noise, same count), only named apart."""
    trainer = Trainer(config_mod.from_dict(raw_config(tmp_path, tiny_qwen2_vl_dir, splits=["ood"])))
    assert list(trainer.eval_items) == ["ood"]
    named = trainer.evaluate(0)
    assert {"eval/ood/score", "eval/ood/accuracy", "eval/ood/completion_tokens"} <= set(named)
    assert all(key.startswith("eval/ood/") for key in named)
    trainer.eval_items = {"eval": trainer.eval_items["ood"]}
    plain = trainer.evaluate(0)
    assert {key.replace("eval/", "eval/ood/", 1): value for key, value in plain.items()} == named


def test_eval_splits_are_checked_before_any_model_loads(tmp_path):
    raw = raw_config(tmp_path, "mmgrpo:vlm_shapes", splits=["eval", "unseen"])
    with pytest.raises(ConfigError, match=r"eval.splits: prompt source 'vlm_shapes' declares no held-out split "
                                          r"'unseen'; it declares \['eval', 'ood'\]"):
        preflight(config_mod.from_dict(raw))
    raw["data"]["ood"], raw["data"]["max_objects"], raw["eval"]["splits"] = False, 4, ["ood"]
    with pytest.raises(ConfigError, match=r"declares no held-out split 'ood'; it declares \['eval'\]"):
        preflight(config_mod.from_dict(raw))
    clash = raw_config(tmp_path, "mmgrpo:vlm_shapes", rewards={"ood": {"name": "accuracy"}})
    with pytest.raises(ConfigError, match="eval.rewards.ood: an eval.rewards entry named after a held-out split"):
        preflight(config_mod.from_dict(clash))
    preflight(config_mod.from_dict(raw_config(tmp_path, "mmgrpo:vlm_shapes", splits=["ood", "eval"])))
    with pytest.raises(ConfigError, match="eval.splits must list distinct held-out split names"):
        config_mod.from_dict(raw_config(tmp_path, "mmgrpo:vlm_shapes", splits=["ood", "ood"]))


def test_sft_reports_the_reward_on_every_chosen_split(tmp_path, tiny_qwen2_vl_dir):
    raw = raw_config(tmp_path, tiny_qwen2_vl_dir)
    raw["sft"] = {"eval_reward": True}
    metrics = SFTTrainer(config_mod.from_dict(raw)).evaluate(0)
    assert {"eval/loss", "eval/accuracy", "eval/ood/accuracy"} <= set(metrics)
    assert (tmp_path / "run" / "eval" / "ood" / "step_00000.json").is_file()
