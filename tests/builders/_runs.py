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


def check_resume_is_exact(tmp_path, tiny_sd3_dir, algorithm: dict, counter) -> None:
    """A 4-step run on the tiny SD3 ([`dgpo_config`]'s with `algorithm` as its ``algorithm`` section) in one go, and
    the same run stopped after 2 steps and resumed from its checkpoint: the resumed algorithm's clock,
    ``counter(algorithm)``, reads 2 at the resume (its EMA restored) and 4 at the end as the full run's, and both runs
    end with equal weights and EMA."""
    import torch

    from mmgrpo import config as config_mod
    from mmgrpo.trainer import Trainer

    def raw(name, steps):
        run = dgpo_config(tmp_path / name, tiny_sd3_dir, steps)
        run["algorithm"] = algorithm
        return run

    full = Trainer(config_mod.from_dict(raw("a", 4)))
    full.train()
    first = raw("b", 2)
    Trainer(config_mod.from_dict(first)).train()
    first["train"]["max_steps"] = 4
    first["checkpoint"]["resume_from"] = "latest"
    resumed = Trainer(config_mod.from_dict(first))
    assert counter(resumed.algorithm) == 2 and resumed.algorithm.ema.shadow is not None
    resumed.train()
    assert counter(full.algorithm) == counter(resumed.algorithm) == 4
    for a, b in zip(full.policy.trainable_parameters(), resumed.policy.trainable_parameters()):
        assert torch.equal(a, b)
    for a, b in zip(full.algorithm.ema.shadow, resumed.algorithm.ema.shadow):
        assert torch.equal(a, b)
