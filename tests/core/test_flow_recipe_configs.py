"""The real-model configs of the flow algorithms carry each paper's published recipe (no weights needed: the configs
are loaded and validated only)."""

from pathlib import Path

import pytest

from mmgrpo import config as config_mod

ROOT = Path(__file__).resolve().parents[2]


def load(name, monkeypatch):
    monkeypatch.chdir(ROOT)  # the configs' prompt files are relative to the repository
    return config_mod.load(ROOT / "configs" / f"{name}.yaml")


# name -> (algorithm, hub id, (resolution, num_steps, guidance_scale), (lora_rank, lora_alpha),
#          (prompts_per_step, group_size, updates_per_step), learning_rate)
RECIPES = {
    "sd3_5_medium_diffusion_nft": ("diffusion_nft", "stabilityai/stable-diffusion-3.5-medium", (512, 10, 1.0),
                                   (32, 64), (48, 24, 1), 3e-4),
    "sd3_5_medium_awm": ("awm", "stabilityai/stable-diffusion-3.5-medium", (512, 14, 1.0), (32, 64), (48, 16, 1),
                         3e-4),
    "sd3_5_medium_grpo_guard": ("flow_grpo", "stabilityai/stable-diffusion-3.5-medium", (512, 10, 4.5), (32, 64),
                                (48, 24, 2), 3e-4),
    "sd3_5_medium_flow_dppo": ("flow_dppo", "stabilityai/stable-diffusion-3.5-medium", (512, 10, 1.0), (32, 64),
                               (48, 16, 2), 3e-4),
    "flux1_dev_dance_grpo": ("dance_grpo", "black-forest-labs/FLUX.1-dev", (720, 16, 3.5), (0, None), (16, 12, 3),
                             1e-5),
    "flux1_dev_mix_grpo": ("mix_grpo", "black-forest-labs/FLUX.1-dev", (720, 25, 3.5), (0, None), (32, 12, 4), 1e-5),
    "flux1_dev_mix_grpo_flash": ("mix_grpo", "black-forest-labs/FLUX.1-dev", (720, 25, 3.5), (0, None), (32, 12, 4),
                                 1e-5),
    "flux1_dev_branch_grpo": ("branch_grpo", "black-forest-labs/FLUX.1-dev", (720, 20, 3.5), (0, None),
                              (16, 16, 16), 1e-5),
}


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_recipe_sizes(name, monkeypatch):
    algorithm, hub_id, sampling, lora, batch, lr = RECIPES[name]
    cfg = load(name, monkeypatch)
    pipe = cfg.pipeline.options
    assert cfg.algorithm.name == algorithm and pipe.pretrained == hub_id
    assert (pipe.resolution, pipe.num_steps, pipe.guidance_scale) == sampling
    assert pipe.lora_rank == lora[0] and (lora[1] is None or pipe.lora_alpha == lora[1])
    assert (cfg.train.prompts_per_step, cfg.train.group_size, cfg.train.updates_per_step) == batch
    assert cfg.train.learning_rate == lr
    if pipe.lora_rank == 0:  # full fine-tuning of a 12B transformer: sharded, checkpointed
        assert cfg.train.sharding == "fsdp" and pipe.gradient_checkpointing and cfg.train.mixed_precision == "bf16"


def test_diffusion_nft_recipe(monkeypatch):
    algo = load("sd3_5_medium_diffusion_nft", monkeypatch).algorithm.options
    assert (algo.beta, algo.decay_type, algo.kl.kl_beta, algo.level_fraction) == (1.0, 1, 1e-4, 0.99)
    assert (algo.solver, algo.flow_shift, algo.advantage.adv_clip_max) == ("dpm", 3.0, 5.0)
    assert algo.advantage.scale_rewards == "batch"  # the authors' global_std


def test_awm_recipe(monkeypatch):
    algo = load("sd3_5_medium_awm", monkeypatch).algorithm.options
    assert (algo.awm_weighting, algo.ghuber_power, algo.num_train_timesteps) == ("ghuber", 0.25, 6)
    assert (algo.time_sampling_strategy, algo.step_range) == ("discrete_wo_init", 0.9)
    assert (algo.kl.kl_beta, algo.ema_kl_beta, algo.ema_decay, algo.ema_warmup_steps) == (1e-4, 1.0, 0.3, 1000)
    assert (algo.advantage.adv_clip_max, algo.advantage.scale_rewards, algo.solver) == (1.0, "batch", "flow")


def test_grpo_guard_recipe(monkeypatch):
    algo = load("sd3_5_medium_grpo_guard", monkeypatch).algorithm.options
    assert algo.ratio.ratio_norm and algo.clip.clip_low == 2e-6
    assert (algo.kl.kl_beta, algo.kl_convention, algo.sde.noise_level, algo.timestep_fraction) == (
        0.04, "flow_grpo", 0.7, 0.99)


def test_flow_dppo_recipe(monkeypatch):
    algo = load("sd3_5_medium_flow_dppo", monkeypatch).algorithm.options
    assert (algo.kl_mask_threshold, algo.add_kl_coefficient, algo.kl.kl_beta) == (1e-5, True, 0.0)
    assert (algo.sde.noise_level, algo.sde_window_size, algo.sde_window_range) == (0.7, 3, [0, 3])
    assert algo.advantage.scale_rewards == "batch"  # adv_use_global_std


def test_dance_mix_branch_recipes(monkeypatch):
    dance = load("flux1_dev_dance_grpo", monkeypatch).algorithm.options
    assert (dance.timestep_fraction, dance.init_same_noise, dance.clip.clip_low) == (0.6, True, 1e-4)
    assert (dance.sde.sde_type, dance.sde.noise_level, dance.advantage.adv_std) == ("dance", 0.3, "unbiased")
    assert dance.bestofn is None  # the FLUX script trains every sample (best-of-N is HunyuanVideo's)
    mix = load("flux1_dev_mix_grpo", monkeypatch).algorithm.options
    assert (mix.window_size, mix.iters_per_group, mix.prog_overlap_step, mix.roll_back) == (4, 25, 1, True)
    assert (mix.sde.sde_type, mix.sde.noise_level, mix.clip.clip_low, mix.old_kl_coeff) == ("sde", 0.7, 1e-4, 0.0)
    assert mix.dpm_algorithm_type is None  # the MixGRPO script's dpm_algorithm_type "null" (no Flash)
    flash = load("flux1_dev_mix_grpo_flash", monkeypatch).algorithm.options  # the _Flash.sh script: these two differ
    assert (flash.dpm_algorithm_type, flash.iters_per_group) == ("dpmsolver++", 20)
    assert (flash.dpm_post_compress_ratio, flash.dpm_solver_type, flash.window_size, flash.prog_overlap_step) == (
        0.4, "midpoint", 4, 1)
    assert (flash.sde.sde_type, flash.sde.noise_level, flash.clip.clip_low) == ("sde", 0.7, 1e-4)
    branch_cfg = load("flux1_dev_branch_grpo", monkeypatch)
    branch = branch_cfg.algorithm.options
    assert (branch.tree_split_points, branch.branch_factor, branch.tree_split_noise_scale) == ([0, 3, 6, 9], 2, 4.0)
    assert branch.branch_factor ** len(branch.tree_split_points) == branch_cfg.train.group_size == 16
    assert (branch.sde.sde_type, branch.sde.noise_level, branch.clip.clip_low) == ("dance", 0.3, 1e-3)
    assert (branch.width_pruning_mode, branch.width_pruning_ratio, branch.tree_prob_weighted) == (0, 0.5, False)
