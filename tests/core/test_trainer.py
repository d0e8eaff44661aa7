"""The trainer loop end to end on a tiny SD3: outputs, exact resume, atomic checkpoints, NaN safety."""

import json

import pytest
import torch

from mmgrpo import checkpoint, config as config_mod
from mmgrpo.trainer import Trainer
from mmgrpo.types import RewardResult


def make_config(tmp_path, tiny_sd3_dir, **train):
    tmp_path.mkdir(parents=True, exist_ok=True)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red circle\na blue square\na green triangle\na yellow circle\n")
    raw = {
        "output_dir": str(tmp_path / "run"),
        "seed": 3,
        "pipeline": {"name": "sd3", "pretrained": tiny_sd3_dir, "resolution": 32, "num_steps": 3,
                     "guidance_scale": 1.0, "lora_rank": 4, "max_sequence_length": 16},
        "algorithm": {"name": "flow_grpo", "clip_low": 0.2},
        "reward": {"name": "jpeg"},
        "data": {"name": "prompt_file", "train_file": str(prompts), "eval_file": str(prompts)},
        "train": {"max_steps": 4, "prompts_per_step": 2, "group_size": 2, "minibatch_size": 2,
                  "learning_rate": 1e-3, **train},
        "eval": {"every": 2, "num_prompts": 4, "grid_size": 4, "metric": "jpeg_kb"},
        "checkpoint": {"every": 2, "keep_last": 5},
    }
    return raw


def weights(trainer):
    return [p.detach().clone() for p in trainer.policy.trainable_parameters()]


def read_metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_run_writes_metrics_samples_curve_and_checkpoints(tmp_path, tiny_sd3_dir):
    raw = make_config(tmp_path, tiny_sd3_dir)
    trainer = Trainer(config_mod.from_dict(raw))
    before = weights(trainer)
    summary = trainer.train()
    run = tmp_path / "run"
    records = read_metrics(run)
    assert [r["step"] for r in records if "reward/mean" in r] == [1, 2, 3, 4]
    assert [r["step"] for r in records if "eval/jpeg_kb" in r] == [0, 2, 4]
    assert all(r["train/ratio_mean"] == pytest.approx(1.0, abs=0.05) for r in records if "train/ratio_mean" in r)
    assert (run / "reward_curve.png").stat().st_size > 1000
    assert sorted(p.name for p in (run / "samples").iterdir()) == ["step_00000.png", "step_00002.png", "step_00004.png"]
    assert [p.name for p in checkpoint.complete_checkpoints(run / "checkpoints")] == ["step_0000002", "step_0000004"]
    assert any(not torch.equal(a, b) for a, b in zip(before, weights(trainer)))
    assert summary["steps"] == 4 and "eval_jpeg_kb_last" in summary
    assert list((run / "tensorboard").iterdir())


def test_resume_reproduces_uninterrupted_run_bitwise(tmp_path, tiny_sd3_dir):
    full = Trainer(config_mod.from_dict(make_config(tmp_path / "a", tiny_sd3_dir)))
    full.train()
    part_raw = make_config(tmp_path / "b", tiny_sd3_dir)
    part_raw["train"]["max_steps"] = 2
    Trainer(config_mod.from_dict(part_raw)).train()
    part_raw["train"]["max_steps"] = 4
    part_raw["checkpoint"]["resume_from"] = "latest"
    resumed = Trainer(config_mod.from_dict(part_raw))
    assert resumed.step == 2
    resumed.train()
    for a, b in zip(weights(full), weights(resumed)):
        assert torch.equal(a, b)
    ma = [r for r in read_metrics(tmp_path / "a" / "run") if r["step"] == 4][0]
    mb = [r for r in read_metrics(tmp_path / "b" / "run") if r["step"] == 4][0]
    for key in ("reward/mean", "train/policy_loss", "eval/jpeg_kb"):
        assert ma[key] == mb[key]


def test_crash_while_saving_keeps_previous_checkpoint(tmp_path, tiny_sd3_dir, monkeypatch):
    trainer = Trainer(config_mod.from_dict(make_config(tmp_path, tiny_sd3_dir)))
    calls = {"n": 0}
    original = trainer.policy.save_pretrained

    def crash_on_second_save(path):
        calls["n"] += 1
        original(path)
        if calls["n"] == 2:
            raise KeyboardInterrupt("killed while saving")

    monkeypatch.setattr(trainer.policy, "save_pretrained", crash_on_second_save)
    with pytest.raises(KeyboardInterrupt):
        trainer.train()
    root = tmp_path / "run" / "checkpoints"
    assert [p.name for p in checkpoint.complete_checkpoints(root)] == ["step_0000002"]
    assert (root / "step_0000004.tmp").is_dir()  # the half-written one is never taken for a checkpoint
    metrics = tmp_path / "run" / "metrics.jsonl"
    metrics.write_text(metrics.read_text() + '{"step": 5, "reward/mean": 0.4, "eval/jp')  # killed mid-write, too
    raw = make_config(tmp_path, tiny_sd3_dir)
    raw["checkpoint"]["resume_from"] = "latest"
    resumed = Trainer(config_mod.from_dict(raw))
    assert resumed.step == 2 and resumed.stream.position == 4
    assert [r["step"] for r in read_metrics(tmp_path / "run")] == [0, 1, 2]  # later steps and the torn line dropped
    last_eval = read_metrics(tmp_path / "run")[-1]["eval/jpeg_kb"]
    metrics.write_text(metrics.read_text() + '{"step": 3, "rew')
    assert resumed._finish()["eval_jpeg_kb_last"] == last_eval  # the summary and the curve skip a torn last line


def test_nan_reward_never_reaches_weights(tmp_path, tiny_sd3_dir):
    raw = make_config(tmp_path, tiny_sd3_dir, max_steps=2)
    raw["eval"]["every"] = 0
    trainer = Trainer(config_mod.from_dict(raw))
    trainer.reward = lambda outputs, batch: RewardResult(scores=torch.full((len(batch),), float("nan")))
    before = weights(trainer)
    trainer.train()
    assert all(torch.equal(a, b) for a, b in zip(before, weights(trainer)))
    records = read_metrics(tmp_path / "run")
    assert records[-1]["train/skipped_updates"] == 2 and records[-1]["reward/invalid"] == 4


def test_nan_loss_is_skipped_and_counted(tmp_path, tiny_sd3_dir):
    raw = make_config(tmp_path, tiny_sd3_dir, max_steps=1)
    raw["eval"]["every"] = 0
    trainer = Trainer(config_mod.from_dict(raw))
    loss_fn = trainer.algorithm.loss

    def nan_loss(*args, **kwargs):
        out = loss_fn(*args, **kwargs)
        out.loss = out.loss * float("nan")
        return out

    trainer.algorithm.loss = nan_loss
    before = weights(trainer)
    trainer.train()
    assert all(torch.equal(a, b) for a, b in zip(before, weights(trainer)))
    assert read_metrics(tmp_path / "run")[-1]["train/skipped_updates"] == 1


def test_max_seconds_stops_after_the_step_that_spent_it_then_evaluates_and_saves(tmp_path, tiny_sd3_dir):
    raw = make_config(tmp_path, tiny_sd3_dir, max_seconds=1e-9)  # any real step takes longer
    raw["eval"]["every"] = 3
    summary = Trainer(config_mod.from_dict(raw)).train()
    run = tmp_path / "run"
    records = read_metrics(run)
    assert summary["steps"] == 1 and summary["train_seconds"] > 0
    assert [r["step"] for r in records if "eval/jpeg_kb" in r] == [0, 1]  # the final evaluation still runs
    assert records[-1]["time/train_s"] == pytest.approx(records[-1]["time/step_s"])
    assert [p.name for p in checkpoint.complete_checkpoints(run / "checkpoints")] == ["step_0000001"]
    assert "eval_jpeg_kb_last" in summary and (run / "samples" / "step_00001.png").is_file()


class FakeClock:
    """Stands in for `time` in the trainer: training steps take 1 s, evaluations 10 s, nothing else takes time."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self):
        return self.now


def fake_timed_trainer(tmp_path, tiny_sd3_dir, monkeypatch, train: dict, eval: dict):
    from mmgrpo import run_loop

    raw = make_config(tmp_path, tiny_sd3_dir, **train)
    raw["eval"].update(eval)
    raw["checkpoint"]["every"] = 0
    trainer = Trainer(config_mod.from_dict(raw))
    clock = FakeClock()
    monkeypatch.setattr(run_loop, "time", clock)  # the shared loop times the steps

    def train_step():
        clock.now += 1.0
        return {"reward/mean": 0.0}

    def evaluate(step):
        clock.now += 10.0
        return {"eval/jpeg_kb": float(step)}

    trainer.train_step, trainer.evaluate = train_step, evaluate
    return trainer


def test_max_seconds_counts_training_steps_only(tmp_path, tiny_sd3_dir, monkeypatch):
    trainer = fake_timed_trainer(tmp_path, tiny_sd3_dir, monkeypatch, {"max_steps": 50, "max_seconds": 2.5}, {"every": 1})
    summary = trainer.train()  # evaluations (10 s each) would spend the budget after one step if they counted
    records = read_metrics(tmp_path / "run")
    assert summary["steps"] == 3 and summary["train_seconds"] == 3.0
    assert [r["time/train_s"] for r in records if "time/train_s" in r] == [1.0, 2.0, 3.0]


def test_eval_every_seconds_spaces_evaluations_in_training_time(tmp_path, tiny_sd3_dir, monkeypatch):
    trainer = fake_timed_trainer(tmp_path, tiny_sd3_dir, monkeypatch, {"max_steps": 7}, {"every": 0, "every_seconds": 2.0})
    trainer.train()
    records = read_metrics(tmp_path / "run")
    assert [r["step"] for r in records if "eval/jpeg_kb" in r] == [0, 2, 4, 6, 7]  # base, every 2 s, and the last


def test_rollout_batch_is_the_training_steps_batch_and_changes_no_weight(tmp_path, tiny_sd3_dir):
    """`Trainer.rollout_batch(1)` samples, rewards and advantages step 1's batch as `train_step` does (same rewards
    and advantages as a second trainer's step 1 logs), and takes no update."""
    measured = Trainer(config_mod.from_dict(make_config(tmp_path / "a", tiny_sd3_dir)), record_config=False)
    before = weights(measured)
    batch = measured.rollout_batch(1)
    measured.scoring.close()
    assert all(torch.equal(a, b) for a, b in zip(before, weights(measured)))
    assert all(p.grad is None for p in measured.policy.trainable_parameters())
    assert batch.scores.shape == batch.groups.shape == batch.with_signal.shape == (4,)
    assert batch.groups.tolist() == [0, 0, 1, 1] and bool(batch.rewarded.all())
    trained = Trainer(config_mod.from_dict(make_config(tmp_path / "b", tiny_sd3_dir)), record_config=False)
    trained.step += 1
    metrics = trained.train_step()
    trained.scoring.close()
    assert metrics["reward/mean"] == pytest.approx(float(batch.scores.mean()), rel=1e-6)
    per_group = batch.scores.view(2, 2)  # [groups, G]: flow_grpo's (r - mean) / (population std + 1e-4) per group
    std = per_group.std(1, keepdim=True, unbiased=False)
    expected = ((per_group - per_group.mean(1, keepdim=True)) / (std + 1e-4)).clamp(-5.0, 5.0)
    torch.testing.assert_close(batch.advantages.view(2, 2), expected, rtol=1e-4, atol=1e-4)
