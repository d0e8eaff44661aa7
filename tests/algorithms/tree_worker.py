"""Run by `test_branch_grpo.py`, alone or under torchrun with 2 processes: one BranchGRPO training step on the tiny
SD3 pipeline with one prompt whose tree of 4 leaves is spread over the processes (2 leaves each under torchrun).
Rank 0 writes the tree's leaf latents (gathered) and the step's metrics.

Usage: ``tree_worker.py TINY_SD3_DIR OUT_DIR [ALGORITHM_OPTIONS_JSON]``.
"""

import json
import sys

import torch

from mmgrpo import config as config_mod
from mmgrpo.seeding import mix_seed
from mmgrpo.trainer import Trainer
from mmgrpo.types import PromptBatch


def run(tiny_sd3_dir: str, out_dir: str, options: dict) -> dict:
    prompts = f"{out_dir}/prompts.txt"
    raw = {
        "output_dir": f"{out_dir}/run",
        "seed": 0,
        "pipeline": {"name": "sd3", "pretrained": tiny_sd3_dir, "resolution": 32, "num_steps": 3,
                     "guidance_scale": 1.0, "lora_rank": 4, "max_sequence_length": 16},
        "algorithm": {"name": "branch_grpo", "tree_split_points": [0, 1], **options},
        "reward": {"name": "jpeg"},
        "data": {"name": "prompt_file", "train_file": prompts, "eval_file": prompts},
        "train": {"max_steps": 1, "prompts_per_step": 1, "group_size": 4, "minibatch_size": 4, "learning_rate": 1e-2},
        "eval": {"every": 0, "num_prompts": 1, "metric": "jpeg_kb"},
        "checkpoint": {"every": 0},
    }
    trainer = Trainer(config_mod.from_dict(raw))
    batch = PromptBatch(["a red circle"]).repeat(4)
    local = batch.select(range(trainer.rank * trainer.local_n, (trainer.rank + 1) * trainer.local_n))
    plan = trainer.algorithm.schedule(trainer.policy.num_steps, torch.Generator().manual_seed(mix_seed(0, 1)))
    rollout = trainer.policy.sample(local, plan, generator=torch.Generator().manual_seed(trainer.rank))
    latents = trainer.accelerator.gather(rollout.trajectory["latents"].to(trainer.accelerator.device)).cpu()
    trainer.step = 1
    metrics = trainer.train_step()
    return {"latents": latents.tolist(), "metrics": metrics, "world": trainer.world, "rank": trainer.rank}


def main(tiny_sd3_dir: str, out_dir: str, options: dict) -> None:
    result = run(tiny_sd3_dir, out_dir, options)
    if result["rank"] == 0:
        with open(f"{out_dir}/result_{result['world']}.json", "w") as f:
            json.dump(result, f)
    if result["world"] > 1:
        from mmgrpo.sharding import end_processes

        end_processes()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], json.loads(sys.argv[3]) if len(sys.argv) > 3 else {})
