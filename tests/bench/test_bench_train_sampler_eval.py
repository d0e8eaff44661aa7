"""bench/train_sampler_eval.py: an algorithm whose rollouts follow the evaluation's own Euler ODE (AWM) scores the
same under both plans; an SDE algorithm's training plan samples other images from the same initial noise; and the
command line."""

import json

import pytest


def test_euler_rollout_algorithm_scores_alike_and_sde_algorithm_samples_otherwise(load_bench, tmp_path, monkeypatch):
    import torch

    from mmgrpo.evaluation import evaluation_plan, sample_and_score

    bench = load_bench("train_sampler_eval")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    awm = bench.build_trainer("configs/tiny/t2i_shapes_awm.yaml", None, tmp_path / "awm")  # solver: flow
    means = bench.score_under_plans(awm, 6, [0, 1], 5)
    awm.scoring.close()
    assert set(means) == {"eval", "train/0", "train/1"}
    assert means["train/0"] == means["eval"] == means["train/1"]  # Euler rollouts: the same samples
    guard = bench.build_trainer("configs/tiny/t2i_shapes_grpo_guard.yaml", None, tmp_path / "guard")
    plan = guard.algorithm.schedule(guard.policy.num_steps, torch.Generator().manual_seed(0))
    assert plan.sde_steps  # the trained sampler is stochastic
    items = guard.eval_items["eval"][:3]
    images = {}
    for name, p in {"eval": evaluation_plan(guard.policy), "train": plan}.items():
        writer = Collect()
        sample_and_score(guard.policy, guard.eval_reward, items, p, torch.Generator().manual_seed(5), [writer])
        images[name] = writer.images
    guard.scoring.close()
    assert images["eval"].shape == images["train"].shape and not torch.equal(images["eval"], images["train"])


class Collect:
    """A sample writer that keeps the samples' images."""

    images = None

    def add(self, outputs, batch, artifacts) -> None:
        self.images = outputs["images"]


def test_command_line_writes_the_table_and_refuses_a_bad_checkpoint(load_bench, tmp_path, monkeypatch):
    bench = load_bench("train_sampler_eval")
    with pytest.raises(SystemExit, match="NAME=PATH"):
        bench.main(["configs/tiny/t2i_shapes_diffusion_nft.yaml", "--checkpoint", "no-name", "--output", str(tmp_path)])
    bench.main(["configs/tiny/t2i_shapes_diffusion_nft.yaml", "--num-prompts", "4", "--plan-seeds", "0",
                "--output", str(tmp_path)])
    results = json.loads((tmp_path / "results.json").read_text())["results"]
    assert list(results) == ["base"] and set(results["base"]) == {"eval", "train/0"}
    assert "| base |" in (tmp_path / "table.md").read_text()
