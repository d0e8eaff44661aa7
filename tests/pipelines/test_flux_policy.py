"""RL correctness of the FLUX adapter with Flow-GRPO, on real diffusers classes built from tiny configs: what is
FLUX's own (dynamic shift, guidance embedding, packed latents, its real config, the trainer on FLUX); the checks
shared with SD3 are in `test_flow_image_policies.py`."""

import json
from pathlib import Path

import pytest
import torch

from mmgrpo.algorithms.flow_grpo import FlowGRPO, FlowGRPOConfig
from mmgrpo.pipelines.flux import FluxConfig, FluxPolicy
from mmgrpo.types import PromptBatch
from mmgrpo.plans import FlowPlan

PROMPTS = ["a red circle", "two blue squares", "a green triangle left of a yellow circle"]
ROOT = Path(__file__).resolve().parents[2]


def make_policy(path, **overrides):
    options = dict(pretrained=path, resolution=32, num_steps=4, lora_rank=4, lora_alpha=8, max_sequence_length=16)
    options.update(overrides)
    return FluxPolicy(FluxConfig(**options))


def test_minibatch_replay_matches_full_batch(tiny_flux_dir):
    policy = make_policy(tiny_flux_dir)
    plan = FlowGRPO(FlowGRPOConfig()).schedule(4)
    rollout = policy.sample(PromptBatch(PROMPTS).repeat(2), plan, generator=torch.Generator().manual_seed(1))
    index = torch.tensor([4, 1])
    with torch.no_grad():
        sub = policy.log_prob(rollout.select(index), [0, 2]).log_prob
    torch.testing.assert_close(sub, rollout.old_log_probs[index][:, [0, 2]], rtol=0, atol=1e-5)


def test_sigmas_follow_flux_dynamic_shift(tiny_flux_dir):
    """Sigmas are FluxPipeline's: linspace(1, 1/S, S) shifted with mu from the packed image length (64 tokens)."""
    import math

    from diffusers.pipelines.flux.pipeline_flux import calculate_shift

    policy = make_policy(tiny_flux_dir)
    sigmas = policy.sigmas(4)
    mu = calculate_shift(64, 256, 4096, 0.5, 1.15)
    base = torch.linspace(1.0, 0.25, 4, dtype=torch.float64)
    expected = math.exp(mu) / (math.exp(mu) + (1 / base - 1))  # the scheduler's exponential time shift
    torch.testing.assert_close(sigmas[:-1].double(), expected, rtol=0, atol=1e-6)
    assert sigmas[-1] == 0 and sigmas.shape == (5,)


def test_guidance_embedding_is_fed(tiny_flux_dir):
    low, high = make_policy(tiny_flux_dir, guidance_scale=1.0), make_policy(tiny_flux_dir, guidance_scale=5.0)
    plan = FlowPlan.deterministic(2)
    a = low.sample(PromptBatch(PROMPTS[:1]), plan, generator=torch.Generator().manual_seed(0)).outputs["images"]
    b = high.sample(PromptBatch(PROMPTS[:1]), plan, generator=torch.Generator().manual_seed(0)).outputs["images"]
    assert not torch.equal(a, b)


def test_branched_merged_plan_replays_and_likelihood_is_differentiable(tiny_flux_dir):
    """The opt-in plan features (shared for sd3 and flux in `mmgrpo.samplers.flow_plan`) run on FLUX's packed latents."""
    policy = make_policy(tiny_flux_dir)
    batch = PromptBatch(PROMPTS[:2]).repeat(2)
    plan = FlowPlan(num_steps=4, sde_steps=[0, 1], train_units=[[0, 1]], noise_level=0.9, merge={0: 2}, branch=True,
                        seed=7)
    rollout = policy.sample(batch, plan, generator=torch.Generator().manual_seed(0))
    replay = policy.log_prob(rollout, [0, 1])
    torch.testing.assert_close(replay.log_prob.detach()[replay.mask], rollout.old_log_probs[:, [0, 1]][replay.mask],
                               rtol=0, atol=1e-5)
    plan = FlowPlan(num_steps=4, sde_steps=[], train_units=[[0], [2]], noise_level=0.0, scoring="likelihood", seed=5)
    rollout = policy.sample(batch, plan, generator=torch.Generator().manual_seed(0))
    first, second = policy.likelihood(rollout, [0, 2]), policy.likelihood(rollout, [0, 2])
    assert first.log_prob.shape == (4, 2) and torch.isfinite(first.log_prob).all()
    torch.testing.assert_close(first.log_prob, second.log_prob, rtol=0, atol=0)
    first.log_prob.sum().backward()
    assert any(p.grad is not None and torch.count_nonzero(p.grad) > 0 for p in policy.trainable_parameters())


def test_config_errors_name_the_fix(tiny_flux_dir):
    with pytest.raises(ValueError, match="multiple of 16"):
        FluxConfig(pretrained=tiny_flux_dir, resolution=40)
    with pytest.raises(ValueError, match="max_sequence_length"):
        FluxConfig(pretrained=tiny_flux_dir, max_sequence_length=1024)
    with pytest.raises(ValueError, match="lora_rank"):
        FluxConfig(pretrained=tiny_flux_dir, lora_rank=-1)


def test_load_trainable_explains_a_missing_lora_file(tiny_flux_dir, tmp_path):
    with pytest.raises(FileNotFoundError, match="lora_rank: 0"):
        make_policy(tiny_flux_dir).load_trainable(tmp_path)


def test_real_flux_config_carries_flow_grpo_hyperparameters(monkeypatch):
    from mmgrpo import config as config_mod

    monkeypatch.chdir(ROOT)
    cfg = config_mod.load(ROOT / "configs" / "flux1_dev_flow_grpo.yaml")
    pipe, algo = cfg.pipeline.options, cfg.algorithm.options
    assert cfg.pipeline.name == "flux" and pipe.pretrained == "black-forest-labs/FLUX.1-dev"
    assert (pipe.num_steps, pipe.eval_num_steps, pipe.guidance_scale, pipe.resolution) == (6, 28, 3.5, 512)
    assert (pipe.lora_rank, pipe.lora_alpha, pipe.weights_dtype) == (64, 128, "bfloat16")
    assert (algo.sde.noise_level, algo.clip.clip_low, algo.kl.kl_beta, algo.timestep_fraction) == (0.9, 1e-4, 0.0, 0.99)
    assert algo.advantage.scale_rewards == "batch"  # the authors' global_std: true
    assert cfg.train.mixed_precision == "bf16" and (cfg.train.prompts_per_step, cfg.train.group_size) == (48, 24)


def test_trainer_runs_flux_and_resumes_bitwise(tmp_path, tiny_flux_dir):
    """The unchanged trainer drives the FLUX policy (prepare, KL reference, checkpoints, eval) and resumes exactly."""
    from mmgrpo import config as config_mod
    from mmgrpo.trainer import Trainer

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red circle\na blue square\na green triangle\n")

    def raw(name, max_steps, resume=None):
        return {
            "output_dir": str(tmp_path / name), "seed": 3,
            "pipeline": {"name": "flux", "pretrained": tiny_flux_dir, "resolution": 32, "num_steps": 3,
                         "lora_rank": 4, "lora_alpha": 8, "max_sequence_length": 16},
            "algorithm": {"name": "flow_grpo", "clip_low": 0.2, "kl_beta": 0.1, "noise_level": 0.9},
            "reward": {"name": "jpeg"},
            "data": {"name": "prompt_file", "train_file": str(prompts), "eval_file": str(prompts)},
            "train": {"max_steps": max_steps, "prompts_per_step": 2, "group_size": 2, "minibatch_size": 2,
                      "learning_rate": 1e-3},
            "eval": {"every": 2, "num_prompts": 2, "grid_size": 2, "metric": "jpeg_kb"},
            "checkpoint": {"every": 1, "keep_last": 2, "resume_from": resume},
        }

    full = Trainer(config_mod.from_dict(raw("a", 2)))
    full.train()
    Trainer(config_mod.from_dict(raw("b", 1))).train()
    resumed = Trainer(config_mod.from_dict(raw("b", 2, resume="latest")))
    assert resumed.step == 1
    resumed.train()
    for a, b in zip(full.policy.trainable_parameters(), resumed.policy.trainable_parameters()):
        assert torch.equal(a, b)
    records = [json.loads(line) for line in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    assert all(r["train/ratio_mean"] == pytest.approx(1.0, abs=0.05) for r in records if "train/ratio_mean" in r)
    assert any("eval/jpeg_kb" in r for r in records)
