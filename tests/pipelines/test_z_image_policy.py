"""The Z-Image adapter on real diffusers classes built from tiny configs (`builders/z_image.py`): ODE sampling equals
the stock `ZImagePipeline` (CFG, its normalisation and truncation, Z-Image-Turbo's few-step schedule), the noise
levels are the stock ones, replay and checkpoints reproduce samples, LoRA and full exports load back in the stock
pipeline."""

import pytest
import torch

from mmgrpo.pipelines.z_image import ZImageConfig, ZImagePolicy
from builders._stock_equality import (
    PROMPTS, StockAdapter, check_export, check_gradient_checkpointing, check_ode_sampling, check_replay,
    load_flow_factory_config, load_stock, ours,
)
from builders._weights import perturb


def make_policy(path, **overrides):
    options = dict(pretrained=path, resolution=32, num_steps=3, guidance_scale=2.0, lora_rank=4, lora_alpha=8,
                   max_sequence_length=32, weights_dtype="float32")
    return ZImagePolicy(ZImageConfig(**{**options, **overrides}))


def stock(path, lora=None):
    from diffusers import ZImagePipeline

    return load_stock(ZImagePipeline, path, lora)


def stock_images(pipe, policy, steps, prompts=PROMPTS[:2], seed=2):
    c = policy.config  # the stock pipeline rewrites the prompt list it is given in place: it gets a copy
    return pipe(prompt=list(prompts), num_inference_steps=steps, guidance_scale=c.guidance_scale, height=32, width=32,
                cfg_normalization=c.cfg_normalization, cfg_truncation=c.cfg_truncation,
                negative_prompt=[c.negative_prompt] * len(prompts) if c.guidance_scale > 0 else None,
                output_type="pt", generator=torch.Generator().manual_seed(seed), max_sequence_length=32).images.float()


ADAPTER = StockAdapter(make_policy, stock, stock_images)


CASES = {
    "cfg": ("tiny_z_image_dir", dict(guidance_scale=2.0), 3),
    "cfg-norm-trunc": ("tiny_z_image_dir", dict(guidance_scale=3.0, cfg_normalization=1.0, cfg_truncation=0.5), 3),
    "turbo-4-steps": ("tiny_z_image_turbo_dir", dict(guidance_scale=0.0), 4),
}


@pytest.mark.parametrize("case", CASES)
def test_ode_sampling_equals_stock_pipeline(request, tmp_path, case):
    fixture, overrides, steps = CASES[case]
    path = request.getfixturevalue(fixture)
    check_ode_sampling(ADAPTER, make_policy(path, **overrides), path, steps, tmp_path)


def test_sigmas_follow_the_dynamic_and_the_turbo_shift(tiny_z_image_dir, tiny_z_image_turbo_dir):
    """Base: linspace(1, 1/S, S) shifted with mu of the 8 x 8 = 64 patches; Turbo: the static shift 3."""
    import math

    from diffusers.pipelines.z_image.pipeline_z_image import calculate_shift

    base = torch.linspace(1.0, 0.25, 4, dtype=torch.float64)
    mu = calculate_shift(64, 256, 4096, 0.5, 1.15)
    dynamic = math.exp(mu) / (math.exp(mu) + (1 / base - 1))
    torch.testing.assert_close(make_policy(tiny_z_image_dir).sigmas(4)[:-1].double(), dynamic, rtol=0, atol=1e-6)
    turbo = 3 * base / (1 + 2 * base)
    sigmas = make_policy(tiny_z_image_turbo_dir, guidance_scale=0.0).sigmas(4)
    torch.testing.assert_close(sigmas[:-1].double(), turbo, rtol=0, atol=1e-6)
    assert sigmas[-1] == 0 and sigmas.shape == (5,)


@pytest.mark.parametrize("guidance", [0.0, 2.0], ids=["no-cfg", "cfg"])
def test_replay_matches_rollout_on_a_few_step_schedule(tiny_z_image_turbo_dir, guidance):
    """Flow-GRPO on a 4-step distilled-style schedule: replayed log-probs equal the rollout's, minibatch or not."""
    check_replay(make_policy(tiny_z_image_turbo_dir, guidance_scale=guidance, num_steps=4), (6, 5, 4, 16, 16))


@pytest.mark.parametrize("lora_rank, merge", [(4, True), (4, False), (0, False)], ids=["lora-merged", "lora", "full"])
def test_export_loads_in_stock_pipeline_with_identical_outputs(tiny_z_image_dir, tmp_path, lora_rank, merge):
    check_export(ADAPTER, tiny_z_image_dir, tmp_path, lora_rank, merge)


@pytest.mark.parametrize("lora_rank", [4, 0], ids=["lora", "full"])
def test_save_and_reload_reproduce_samples(tiny_z_image_dir, tmp_path, lora_rank):
    policy = make_policy(tiny_z_image_dir, lora_rank=lora_rank)
    perturb(policy, seed=3)
    policy.save_pretrained(str(tmp_path / "ckpt"))
    reloaded = make_policy(tiny_z_image_dir, lora_rank=lora_rank)
    reloaded.load_trainable(str(tmp_path / "ckpt"))
    assert torch.equal(ours(policy, 3), ours(reloaded, 3))


def test_config_errors_name_the_fix(tiny_z_image_dir):
    with pytest.raises(ValueError, match="multiple of 16"):
        ZImageConfig(pretrained=tiny_z_image_dir, resolution=40)
    with pytest.raises(ValueError, match="cfg_truncation"):
        ZImageConfig(pretrained=tiny_z_image_dir, cfg_truncation=1.5)
    with pytest.raises(ValueError, match="guidance_scale"):
        ZImageConfig(pretrained=tiny_z_image_dir, guidance_scale=-1.0)


def test_real_config_carries_flow_factorys_recipe(monkeypatch):
    cfg = load_flow_factory_config(monkeypatch, "z_image_turbo_flow_grpo", noise_level=0.7)
    pipe = cfg.pipeline.options
    assert cfg.pipeline.name == "z_image" and pipe.pretrained == "Tongyi-MAI/Z-Image-Turbo"
    assert (pipe.resolution, pipe.num_steps, pipe.eval_num_steps, pipe.guidance_scale) == (512, 6, 10, 0.0)
    assert (pipe.lora_rank, pipe.lora_alpha, pipe.weights_dtype) == (64, 128, "float32")


def test_gradient_checkpointing_gives_the_same_replay_and_gradient(tiny_z_image_dir):
    check_gradient_checkpointing(make_policy, tiny_z_image_dir)


def test_trainer_runs_z_image_and_mmgrpo_export_loads_in_the_stock_pipeline(tmp_path, tiny_z_image_dir):
    """The unchanged trainer drives the Z-Image policy (Flow-GRPO with KL, CFG) to a checkpoint; ``mmgrpo export``
    writes a diffusers folder and card that the stock `ZImagePipeline` loads, sampling as the checkpoint does."""
    from mmgrpo import cli, config as config_mod
    from mmgrpo.trainer import Trainer

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red circle\na blue square\na green triangle\n")
    raw = {
        "output_dir": str(tmp_path / "run"), "seed": 3,
        "pipeline": {"name": "z_image", "pretrained": tiny_z_image_dir, "resolution": 32, "num_steps": 3,
                     "guidance_scale": 2.0, "lora_rank": 4, "lora_alpha": 8, "max_sequence_length": 32,
                     "weights_dtype": "float32"},
        "algorithm": {"name": "flow_grpo", "kl_beta": 0.1, "noise_level": 0.9},
        "reward": {"name": "jpeg"},
        "data": {"name": "prompt_file", "train_file": str(prompts), "eval_file": str(prompts)},
        "train": {"max_steps": 1, "prompts_per_step": 2, "group_size": 2, "minibatch_size": 2, "learning_rate": 1e-2},
        "eval": {"every": 0},
        "checkpoint": {"every": 1, "keep_last": 1},
    }
    trainer = Trainer(config_mod.from_dict(raw))
    trainer.train()
    assert cli.main(["export", str(trainer.output_dir), str(tmp_path / "model"), "--merge-lora"]) == 0
    card = (tmp_path / "model" / "README.md").read_text()
    assert card.startswith("---\nlibrary_name: diffusers\n") and "ZImagePipeline.from_pretrained" in card
    policy = make_policy(tiny_z_image_dir)
    policy.load_trainable(str(sorted((trainer.output_dir / "checkpoints").glob("step_*"))[-1] / "weights"))
    torch.testing.assert_close(stock_images(stock(tmp_path / "model"), policy, 3), ours(policy, 3), rtol=0, atol=1e-4)
