"""Run by `test_ddp.py` under torchrun with 2 processes: gathers advantages across ranks, trains 2 steps
and evaluates (one held-out prompt per rank)."""

import json
import sys

import torch

from mmgrpo import config as config_mod
from mmgrpo.trainer import Trainer

SCORES = torch.tensor([0.1, 0.7, 0.3, 0.9, 0.5, 0.2])  # [N], groups [0, 0, 1, 1, 2, 2]


def main(tiny_sd3_dir: str, out_dir: str) -> None:
    prompts = f"{out_dir}/prompts.txt"
    raw = {
        "output_dir": f"{out_dir}/run",
        "seed": 0,
        "pipeline": {"name": "sd3", "pretrained": tiny_sd3_dir, "resolution": 32, "num_steps": 3,
                     "guidance_scale": 1.0, "lora_rank": 4, "max_sequence_length": 16},
        "algorithm": {"name": "flow_grpo", "clip_range": 0.2},
        "reward": {"name": "jpeg"},
        "data": {"name": "prompt_file", "train_file": prompts, "eval_file": prompts},
        "train": {"max_steps": 2, "prompts_per_step": 3, "group_size": 2, "minibatch_size": 2, "learning_rate": 1e-2},
        "eval": {"every": 0, "num_prompts": 2, "metric": "jpeg_kb"},
    }
    trainer = Trainer(config_mod.from_dict(raw))
    acc = trainer.accelerator
    n = trainer.local_n
    group_ids = torch.tensor([0, 0, 1, 1, 2, 2])[acc.process_index * n : (acc.process_index + 1) * n]
    local_adv, _, all_groups, _ = trainer.global_advantages(SCORES[acc.process_index * n : (acc.process_index + 1) * n], group_ids)
    gathered_adv = acc.gather(local_adv.to(acc.device)).cpu()
    initial = torch.cat([p.detach().flatten() for p in trainer.policy.trainable_parameters()])
    trainer.train()
    flat = torch.cat([p.detach().flatten() for p in trainer.policy.trainable_parameters()])  # [P]
    all_flat = acc.gather(flat[None].to(acc.device)).cpu()  # [world, P]
    evaluation = trainer.evaluate(7)  # one held-out prompt per rank, gathered
    if acc.is_main_process:
        result = {
            "world_size": acc.num_processes,
            "distributed_type": str(acc.distributed_type),
            "advantages": gathered_adv.tolist(),
            "group_ids": all_groups.tolist(),
            "ranks_equal": bool(torch.equal(all_flat[0], all_flat[1])),
            "moved": not torch.equal(initial, flat),
            "eval_jpeg_kb": evaluation["eval/jpeg_kb"],
            "per_prompt": json.loads((trainer.output_dir / "eval" / "step_00007.json").read_text()),
        }
        with open(f"{out_dir}/result.json", "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
