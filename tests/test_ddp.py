"""Two CPU processes under torchrun: world size 2, advantages equal to the single-process ones on the same data
(a group spans both ranks), the ranks' weights stay equal after training steps, and the evaluation gathers both
ranks' prompts."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mmgrpo.advantages import group_normalize

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
    scores = torch.tensor([0.1, 0.7, 0.3, 0.9, 0.5, 0.2])
    groups = torch.tensor([0, 0, 1, 1, 2, 2])
    assert result["group_ids"] == groups.tolist()
    expected = group_normalize(scores, groups, clip=5.0)  # one process seeing the whole batch
    torch.testing.assert_close(torch.tensor(result["advantages"]), expected)
    # group 1 = samples 2 (rank 0) and 3 (rank 1): normalised together, so +-1 (up to eps), not 0
    assert abs(result["advantages"][2] + 1) < 1e-2 and abs(result["advantages"][3] - 1) < 1e-2
    assert result["moved"] and result["ranks_equal"]
    # the per-prompt evaluation holds both ranks' items, and its mean is the gathered metric
    rows = result["per_prompt"]
    assert sorted(r["prompt"] for r in rows) == ["a blue square", "a red circle"] and [r["n"] for r in rows] == [1, 1]
    assert sum(r["jpeg_kb"] for r in rows) / 2 == pytest.approx(result["eval_jpeg_kb"], rel=1e-6)
