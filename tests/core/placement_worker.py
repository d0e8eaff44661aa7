"""Run by `test_group_placement.py` under torchrun with 2 processes: the same run with ``train.group_placement``
``spread`` and ``contiguous`` (each process holds whole groups), with a per-group normalising composite reward (a
group stage). On the same fixed images it computes the advantages both ways; then one real training step of each
trainer (same seed: same rollouts). Rank 0 writes what the test compares.

Usage: ``placement_worker.py TINY_SD3_DIR OUT_DIR``.
"""

import json
import sys

import torch

from ddp_worker import REWARD, fixed_images
from mmgrpo import config as config_mod
from mmgrpo.trainer import Trainer
from mmgrpo.types import PromptBatch

GROUPS = torch.tensor([0, 0, 0, 1, 1, 1])  # [N]: 3 samples per rank, one whole group each


def run(tiny_sd3_dir: str, out_dir: str, placement: str) -> dict:
    prompts = f"{out_dir}/prompts.txt"
    raw = {
        "output_dir": f"{out_dir}/run_{placement}",
        "seed": 0,
        "pipeline": {"name": "sd3", "pretrained": tiny_sd3_dir, "resolution": 32, "num_steps": 3,
                     "guidance_scale": 1.0, "lora_rank": 4, "max_sequence_length": 16},
        "algorithm": {"name": "flow_grpo"},
        "reward": REWARD,
        "data": {"name": "prompt_file", "train_file": prompts, "eval_file": prompts},
        "train": {"max_steps": 1, "prompts_per_step": 2, "group_size": 3, "minibatch_size": 3, "learning_rate": 1e-2,
                  "group_placement": placement},
        "eval": {"every": 0, "num_prompts": 2, "metric": "jpeg/jpeg_kb"},
        "checkpoint": {"every": 0},
    }
    trainer = Trainer(config_mod.from_dict(raw))
    mine = list(range(trainer.rank * trainer.local_n, (trainer.rank + 1) * trainer.local_n))
    batch = PromptBatch(["p"] * len(mine), group_ids=GROUPS[mine])
    local = trainer.reward({"images": fixed_images(mine)}, batch)  # per sample, this rank's group
    placed = trainer.local_advantages if placement == "contiguous" else trainer.global_advantages
    whole, groups, advantages = placed(local, batch.group_ids)
    calls = []  # which path the training step takes: the gather of per-sample rewards, or the local stage
    for name in ("gather_rewards", "local_advantages"):
        method = getattr(trainer, name)
        setattr(trainer, name, lambda *args, _method=method, _name=name: calls.append(_name) or _method(*args))
    trainer.step = 1
    metrics = trainer.train_step()
    return {"calls": calls, "scores": whole.scores.tolist(), "groups": groups.tolist(), "advantages": advantages.tolist(),
            "components": {name: values.tolist() for name, values in whole.components.items()},
            "metrics": metrics, "world": trainer.world}


def main(tiny_sd3_dir: str, out_dir: str) -> None:
    import torch.distributed as dist

    result = {placement: run(tiny_sd3_dir, out_dir, placement) for placement in ("spread", "contiguous")}
    if dist.get_rank() == 0:
        with open(f"{out_dir}/result.json", "w") as f:
            json.dump(result, f)
    from mmgrpo.sharding import end_processes

    end_processes()  # no process tears down its connections while another still uses them


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
