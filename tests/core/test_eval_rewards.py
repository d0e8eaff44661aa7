"""``eval.rewards`` (held-out samples scored by other rewards, each logged under its own name) and
``checkpoint.keep_best`` (the best evaluated checkpoint kept beside the last ones, remembered across a resume), on the
tiny SD3 run of test_trainer and the loopback judge of tests/judge_server.py."""

import json

import pytest
import torch

from judge_server import judge_server, red_images  # noqa: F401
from mmgrpo import checkpoint, config as config_mod
from mmgrpo.eval_rewards import HeldOutScorer
from mmgrpo.preflight import preflight
from mmgrpo.rewards.composite import CompositeConfig, CompositeReward
from mmgrpo.rewards.judge_pairwise import JudgePairwiseConfig, JudgePairwiseReward
from mmgrpo.trainer import Trainer
from mmgrpo.types import PromptBatch
from mmgrpo.validation import ConfigError, build_dataclass
from test_trainer import make_config, read_metrics


def _judge(server) -> dict:
    return {"name": "judge", "url": server.url, "timeout": 5.0, "retries": 0}


def test_other_rewards_score_the_same_samples_and_the_best_checkpoint_is_kept(tmp_path, tiny_sd3_dir, judge_server):
    raw = make_config(tmp_path, tiny_sd3_dir)
    raw["eval"]["rewards"] = {"incompress": {"name": "jpeg", "mode": "incompressibility"}, "red": _judge(judge_server)}
    raw["checkpoint"]["keep_best"] = "eval/incompress/score"
    summary = Trainer(config_mod.from_dict(raw)).train()
    run = tmp_path / "run"
    evals = [r for r in read_metrics(run) if "eval/score" in r]
    assert [r["step"] for r in evals] == [0, 2, 4]
    for record in evals:  # the same samples: JPEG incompressibility is minus the trained compressibility
        assert record["eval/incompress/score"] == pytest.approx(-record["eval/score"], rel=1e-6)
        assert record["eval/incompress/jpeg_kb"] == pytest.approx(record["eval/jpeg_kb"], rel=1e-6)
        assert 0.2 <= record["eval/red/score"] <= 1.0 and record["eval/red/failed"] == 0.0  # the judge answered
    best = max(evals, key=lambda r: (r["eval/incompress/score"], -r["step"]))  # the first of the highest
    kept = checkpoint.complete_checkpoints(run / "checkpoints" / "best")
    assert [p.name for p in kept] == [f"step_{best['step']:07d}"]
    meta = checkpoint.read_metadata(kept[0])
    assert meta["best"] == {"metric": "eval/incompress/score", "value": best["eval/incompress/score"]}
    assert summary["best_checkpoint"] == str(kept[0]) and summary["best_step"] == best["step"]
    assert json.loads((run / "summary.json").read_text())["best_value"] == best["eval/incompress/score"]
    assert [p.name for p in checkpoint.complete_checkpoints(run / "checkpoints")] == ["step_0000002", "step_0000004"]
    checkpoint.verify(kept[0])  # a whole checkpoint: weights, optimizer, schedule

    raw["checkpoint"]["resume_from"] = "latest"  # a resumed run knows the best so far
    raw["train"]["max_steps"] = 5
    resumed = Trainer(config_mod.from_dict(raw))
    assert (resumed.best.value, resumed.best.step, resumed.best.path) == (best["eval/incompress/score"],
                                                                         best["step"], kept[0])
    evaluating = Trainer(config_mod.from_dict({**raw, "checkpoint": {"keep_best": "eval/score"}}),
                         record_config=False)  # as `mmgrpo eval`: never saves
    evaluating.evaluate(7)
    assert evaluating.best.path is None and not (run / "checkpoints" / "best" / "step_0000007").exists()


def test_a_missing_metric_is_a_one_line_error(tmp_path, tiny_sd3_dir):
    raw = make_config(tmp_path, tiny_sd3_dir)
    raw["checkpoint"]["keep_best"] = "eval/nope"
    with pytest.raises(RuntimeError, match=r"keep_best: eval/nope is not among .*eval/jpeg_kb"):
        Trainer(config_mod.from_dict(raw)).evaluate(0)


@pytest.mark.parametrize("section, value, match", [
    ("eval", {"rewards": {"x": {"name": "no_such_reward"}}}, "eval.rewards.x.name"),
    ("eval", {"rewards": {"score": {"name": "jpeg"}}}, "eval.rewards"),
    ("eval", {"rewards": {"a/b": {"name": "jpeg"}}}, "eval.rewards"),
    ("eval", {"rewards": {"jpeg": {"mode": "smaller"}}}, "eval.rewards.jpeg.mode"),
    ("eval", {"rewards": {"jpeg": 3}}, "eval.rewards.jpeg"),
    ("checkpoint", {"keep_best": "score"}, "checkpoint.keep_best"),
    ("checkpoint", {"keep_best": "eval/score", "keep_best_mode": "largest"}, "keep_best_mode"),
])
def test_options_are_checked_when_the_config_is_read(tmp_path, section, value, match):
    raw = make_config(tmp_path, "org/tiny-sd3")
    raw[section] = {**raw[section], **value}
    with pytest.raises(ConfigError, match=match):
        config_mod.from_dict(raw)


def test_preflight_checks_modalities_and_that_the_run_evaluates(tmp_path):
    raw = make_config(tmp_path, "org/tiny-sd3")
    raw["eval"]["rewards"] = {"fmt": {"name": "format"}}  # a text reward on an image pipeline
    with pytest.raises(ConfigError, match=r"eval.rewards.fmt: reward 'format' scores \['text'\]"):
        preflight(config_mod.from_dict(raw))
    raw = make_config(tmp_path, "org/tiny-sd3")
    raw["eval"]["every"] = 0
    raw["checkpoint"]["keep_best"] = "eval/score"
    with pytest.raises(ConfigError, match="does not evaluate"):
        preflight(config_mod.from_dict(raw))


def test_each_rewards_group_stage_runs_on_its_part(judge_server):
    trained = CompositeReward(CompositeConfig(rewards={"jpeg": {}}, normalize="sum_then_group_normalize"))
    pairwise = JudgePairwiseReward(build_dataclass(
        JudgePairwiseConfig, {"url": judge_server.url, "template": "PAIR {prompt}", "timeout": 5.0}, "reward"))
    scorer = HeldOutScorer(trained, {"pairs": pairwise})
    groups = torch.tensor([0, 0, 0, 1, 1])
    outputs = {"images": red_images([0.9, 0.1, 0.5, 0.3, 0.6])}
    batch = PromptBatch(["a"] * 3 + ["b"] * 2, group_ids=groups)
    staged = scorer.group_stage(scorer(outputs, batch), groups)
    alone = trained.group_stage(trained(outputs, batch), groups)
    torch.testing.assert_close(staged.scores, alone.scores, rtol=0, atol=0)  # the trained reward's own result
    torch.testing.assert_close(staged.components["pairs/score"], torch.tensor([1.0, 0.0, 0.5, 0.0, 1.0]))
    assert staged.components["pairs/judge_calls"].tolist() == [6.0, 6.0, 6.0, 2.0, 2.0]
    assert set(alone.components) < set(staged.components)
