"""A run that fails outside the program (the reward server stopped) ends in one line: ``mmgrpo train`` prints
``mmgrpo: <message>`` on stderr and exits with status 1, without a traceback."""

import subprocess
import sys

import pytest
import yaml

from mmgrpo.errors import RunError
from mmgrpo.reward_server import RewardServer
from mmgrpo.rewards.accuracy import AccuracyReward
from mmgrpo.rewards.remote import RemoteRewardError


def test_remote_reward_errors_are_run_errors():
    assert issubclass(RemoteRewardError, RunError)


@pytest.mark.parametrize("command", ["train", "eval"])
def test_a_run_whose_reward_server_stopped_ends_in_one_line(tmp_path, command):
    server = RewardServer(AccuracyReward(), "accuracy").start()
    url = server.url
    server.stop()  # the server is gone before the run scores anything
    config = {
        "output_dir": str(tmp_path / "run"), "seed": 0,
        "pipeline": {"name": "mdlm", "pretrained": "mmgrpo:mdlm_arith", "gen_length": 4, "steps_per_block": 4,
                     "lora_rank": 0},
        "algorithm": {"name": "cj_grpo"},
        "reward": {"name": "remote", "url": url, "retries": 0, "timeout": 5.0, "modalities": ["text"]},
        "data": {"name": "arith", "digits": 2, "n_train": 4, "n_eval": 2},
        "train": {"max_steps": 2, "prompts_per_step": 2, "group_size": 2, "minibatch_size": 4},
        "eval": {"every": 0, "num_prompts": 2},
    }
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    run = subprocess.run([sys.executable, "-m", "mmgrpo.cli", command, str(tmp_path / "config.yaml")],
                         capture_output=True, text=True, timeout=300)
    last = run.stderr.strip().splitlines()[-1]
    assert run.returncode == 1, run.stderr[-2000:]
    assert last.startswith("mmgrpo: remote reward: no answer from") and "serve-reward" in last
    assert "Traceback" not in run.stderr
