"""Two CPU processes under torchrun: world size 2, a per-group normalising composite reward whose group spans both
ranks gives the same scores and advantages as one process on the same data (its group stage runs after the gather),
training with it keeps the ranks' weights equal, and the evaluation gathers both ranks' prompts."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ddp_worker import GROUPS, REWARD, fixed_images
from mmgrpo import registry
from mmgrpo.config import build_dataclass
from mmgrpo.rewards.composite import CompositeReward
from mmgrpo.types import PromptBatch

WORKER = Path(__file__).with_name("ddp_worker.py")


def test_two_process_training_matches_single_process(tmp_path, tiny_sd3_dir):
    (tmp_path / "prompts.txt").write_text("a red circle\na blue square\na green triangle\n")
    env = dict(os.environ, ACCELERATE_USE_CPU="true", OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         str(WORKER), tiny_sd3_dir, str(tmp_path)],
        capture_output=True, text=True, timeout=600, env=env,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["world_size"] == 2, result
    assert "MULTI_CPU" in result["distributed_type"]
    assert result["group_ids"] == GROUPS.tolist()
    # one process scoring all six samples, its group stage on whole groups
    options = build_dataclass(CompositeReward.Config, {k: v for k, v in REWARD.items() if k != "name"}, "reward")
    reward = CompositeReward(options)
    per_sample = reward({"images": fixed_images(range(6))}, PromptBatch(["p"] * 6, group_ids=GROUPS))
    one = reward.group_stage(per_sample, GROUPS)
    assert result["scores"] == one.scores.tolist()  # bitwise
    assert result["components"] == {name: values.tolist() for name, values in one.components.items()}
    algorithm_cls = registry.get("algorithm", "flow_grpo")
    expected = algorithm_cls(algorithm_cls.Config()).advantages(one.scores, GROUPS)
    torch.testing.assert_close(torch.tensor(result["advantages"]), expected, rtol=0, atol=0)
    # group 1 = samples 2 (rank 0) and 3 (rank 1), normalised together: opposite scores (both components rank them
    # alike), where rank 0 normalising alone would see sample 2 as a group of one and score it 0
    assert abs(result["scores"][2]) > 1 and result["scores"][2] == pytest.approx(-result["scores"][3], rel=1e-5)
    alone = reward.group_stage(reward({"images": fixed_images(range(3))}, PromptBatch(["p"] * 3)), GROUPS[:3])
    assert alone.scores[2] == 0
    assert result["moved"] and result["ranks_equal"]
    # the per-prompt evaluation holds both ranks' items, and its mean is the gathered metric
    rows = result["per_prompt"]
    assert sorted(r["prompt"] for r in rows) == ["a blue square", "a red circle"] and [r["n"] for r in rows] == [1, 1]
    assert sum(r["jpeg/jpeg_kb"] for r in rows) / 2 == pytest.approx(result["eval_jpeg_kb"], rel=1e-6)
    assert sorted(i for r in rows for i in r["items"]) == [0, 1]  # each rank's item by its held-out index
