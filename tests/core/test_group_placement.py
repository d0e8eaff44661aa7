"""``train.group_placement``: with ``contiguous`` every group lies on one process and its reward group stage and
advantages are computed there; two CPU processes (torchrun) give the same scores, advantages and training step as
``spread`` (group stage and advantages after the gather). The option's refusals need no process group."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mmgrpo import registry, sharding
from mmgrpo.algorithms.flow_grpo import FlowGRPOConfig
from mmgrpo.algorithms.grpo import GRPOConfig
from mmgrpo.sections import TrainConfig
from mmgrpo.validation import ConfigError
from algorithm_options import algo_config

WORKER = Path(__file__).with_name("placement_worker.py")


def test_contiguous_matches_spread_on_two_processes(tmp_path, tiny_sd3_dir):
    (tmp_path / "prompts.txt").write_text("a red circle\na blue square\na green triangle\n")
    env = dict(os.environ, ACCELERATE_USE_CPU="true", OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(WORKER),
         tiny_sd3_dir, str(tmp_path)],
        capture_output=True, text=True, timeout=600, env=env,
    )
    first = proc.stderr.find("Traceback")
    assert proc.returncode == 0, proc.stderr[first : first + 4000] if first >= 0 else proc.stderr[-4000:]
    result = json.loads((tmp_path / "result.json").read_text())
    spread, contiguous = result["spread"], result["contiguous"]
    assert spread["world"] == contiguous["world"] == 2
    assert spread["calls"] == ["gather_rewards"] and contiguous["calls"] == ["local_advantages"]  # the step's path
    assert contiguous["groups"] == spread["groups"] == [0, 0, 0, 1, 1, 1]
    assert contiguous["scores"] == pytest.approx(spread["scores"], rel=1e-6, abs=1e-7)
    assert contiguous["advantages"] == pytest.approx(spread["advantages"], rel=1e-6, abs=1e-7)
    assert contiguous["components"].keys() == spread["components"].keys()
    assert max(abs(a) for a in spread["advantages"]) > 0.5  # not vacuous: the groups' samples differ
    # one training step through each path: the same rollouts give the same rewards, losses and gradient norm
    assert contiguous["metrics"].keys() == spread["metrics"].keys()
    for key, value in spread["metrics"].items():
        if key.startswith("time/"):  # wall-clock measurements, not results
            continue
        assert contiguous["metrics"][key] == pytest.approx(value, rel=1e-5, abs=1e-7), key
    assert spread["metrics"]["train/grad_norm"] > 0


def test_contiguous_placement_is_refused_where_it_cannot_hold():
    assert TrainConfig().group_placement == "spread"
    with pytest.raises(ConfigError, match="group_placement must be 'spread' or 'contiguous'"):
        TrainConfig(group_placement="local")
    contiguous = TrainConfig(group_placement="contiguous", prompts_per_step=3)
    local = registry.get("algorithm", "flow_grpo")(FlowGRPOConfig()).traits
    batch_std = [registry.get("algorithm", "flow_grpo")(algo_config(FlowGRPOConfig, scale_rewards="batch")).traits,
                 registry.get("algorithm", "grpo")(algo_config(GRPOConfig, scale_rewards="batch")).traits]
    sharding.check_group_placement(contiguous, 1, batch_std[0])  # one process holds every group
    sharding.check_group_placement(contiguous, 3, local)
    with pytest.raises(ValueError, match="prompts_per_step 3 does not split over 2 processes"):
        sharding.check_group_placement(contiguous, 2, local)
    for traits in batch_std:
        with pytest.raises(ValueError, match="normalises them over the whole batch"):
            sharding.check_group_placement(contiguous, 3, traits)
    sharding.check_group_placement(TrainConfig(prompts_per_step=3), 2, batch_std[0])  # spread
