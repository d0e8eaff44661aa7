"""Run by `test_ddp.py` under torchrun with 2 processes: a per-group normalising composite reward scores fixed images
whose group 1 spans both ranks (gathered, then its group stage on the whole batch), trains 2 steps with that reward
and evaluates (one held-out prompt per rank)."""

import json
import sys

import torch

from mmgrpo import config as config_mod
from mmgrpo.trainer import Trainer
from mmgrpo.types import PromptBatch

GROUPS = torch.tensor([0, 0, 1, 1, 2, 2])  # [N]: 3 samples per rank, so group 1 = sample 2 (rank 0) + sample 3 (rank 1)
REWARD = {"name": "composite", "normalize": "group_normalize_then_sum",
          "rewards": {"jpeg": {"weight": 1.0}, "coarse": {"name": "jpeg", "quality": 20, "weight": 0.5}}}


def fixed_images(index) -> torch.Tensor:
    """Sample `i`'s image `[3, 16, 16]`, the same on any process: noise of growing contrast (growing JPEG sizes)."""
    return torch.stack([torch.rand(3, 16, 16, generator=torch.Generator().manual_seed(100 + i)) * (i + 1) / 6
                        for i in index])  # [len(index), 3, 16, 16]


def main(tiny_sd3_dir: str, out_dir: str) -> None:
    prompts = f"{out_dir}/prompts.txt"
    raw = {
        "output_dir": f"{out_dir}/run",
        "seed": 0,
        "pipeline": {"name": "sd3", "pretrained": tiny_sd3_dir, "resolution": 32, "num_steps": 3,
                     "guidance_scale": 1.0, "lora_rank": 4, "max_sequence_length": 16},
        "algorithm": {"name": "flow_grpo"},
        "reward": REWARD,
        "data": {"name": "prompt_file", "train_file": prompts, "eval_file": prompts},
        "train": {"max_steps": 2, "prompts_per_step": 3, "group_size": 2, "minibatch_size": 2, "learning_rate": 1e-2},
        "eval": {"every": 0, "num_prompts": 2, "metric": "jpeg/jpeg_kb"},
    }
    trainer = Trainer(config_mod.from_dict(raw))
    acc = trainer.accelerator
    mine = list(range(acc.process_index * trainer.local_n, (acc.process_index + 1) * trainer.local_n))
    batch = PromptBatch(["p"] * len(mine), group_ids=GROUPS[mine])
    local = trainer.reward({"images": fixed_images(mine)}, batch)  # per sample, this rank's 3
    whole, all_groups = trainer.gather_rewards(local, batch.group_ids)  # the group stage on all 6
    advantages = trainer.algorithm.advantages(whole.scores.float(), all_groups)
    initial = torch.cat([p.detach().flatten() for p in trainer.policy.trainable_parameters()])
    trainer.train()
    flat = torch.cat([p.detach().flatten() for p in trainer.policy.trainable_parameters()])  # [P]
    all_flat = acc.gather(flat[None].to(acc.device)).cpu()  # [world, P]
    evaluation = trainer.evaluate(7)  # one held-out prompt per rank, gathered
    if acc.is_main_process:
        result = {
            "world_size": acc.num_processes,
            "distributed_type": str(acc.distributed_type),
            "scores": whole.scores.tolist(),
            "components": {name: values.tolist() for name, values in whole.components.items()},
            "advantages": advantages.tolist(),
            "group_ids": all_groups.tolist(),
            "ranks_equal": bool(torch.equal(all_flat[0], all_flat[1])),
            "moved": not torch.equal(initial, flat),
            "eval_jpeg_kb": evaluation["eval/jpeg/jpeg_kb"],
            "per_prompt": json.loads((trainer.output_dir / "eval" / "step_00007.json").read_text()),
        }
        with open(f"{out_dir}/result.json", "w") as f:
            json.dump(result, f)
    from mmgrpo.sharding import end_processes

    end_processes()  # no process tears down its connections while another still uses them


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
