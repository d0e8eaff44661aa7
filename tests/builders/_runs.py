"""Tiny training-run configs that tests in several folders share."""


def dgpo_config(tmp_path, tiny_sd3_dir, max_steps):
    """A DGPO run of `max_steps` steps on the tiny SD3 (`tiny_sd3_dir`) in `tmp_path`, checkpointing every 2 steps."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red circle\na blue square\na green triangle\n")
    return {
        "output_dir": str(tmp_path / "run"),
        "seed": 5,
        "pipeline": {"name": "sd3", "pretrained": tiny_sd3_dir, "resolution": 32, "num_steps": 3,
                     "guidance_scale": 1.0, "lora_rank": 4, "max_sequence_length": 16},
        "algorithm": {"name": "dgpo", "trunc_steps": 1, "num_train_timesteps": 2, "ema_decay_rate": 0.1},
        "reward": {"name": "jpeg"},
        "data": {"name": "prompt_file", "train_file": str(prompts), "eval_file": str(prompts)},
        "train": {"max_steps": max_steps, "prompts_per_step": 2, "group_size": 2, "minibatch_size": 4,
                  "learning_rate": 1e-3},
        "eval": {"every": 0},
        "checkpoint": {"every": 2, "keep_last": 3},
    }


def held_out_flow_rollout(config_path, count):
    """The policy of a flow config sampling its first `count` held-out prompts as evaluation does (deterministic
    steps, noise seed 0): ``(config, batch, rollout, reward)``. Relative paths in the config resolve from the current
    folder."""
    import torch

    from mmgrpo import config as config_mod
    from mmgrpo.prompt_stream import items_to_batch
    from mmgrpo.components import build_components
    from mmgrpo.plans import FlowPlan

    config = config_mod.load(config_path)
    policy, _, reward, data = build_components(config)
    batch = items_to_batch(data.eval_items()[:count])
    rollout = policy.sample(batch, FlowPlan.deterministic(policy.eval_num_steps),
                            generator=torch.Generator().manual_seed(0))
    return config, batch, rollout, reward
