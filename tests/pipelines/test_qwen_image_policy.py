"""The Qwen-Image adapter on real diffusers classes built from tiny configs (`builders/qwen_image.py`): ODE sampling
equals the stock `QwenImagePipeline` (true CFG with a negative prompt and its norm rescale, or none), the noise levels
are the stock ones (dynamic and terminal shift), replay reproduces the rollout's log-probabilities, LoRA and full
exports load back in the stock pipeline, gradient checkpointing changes nothing. (Saving and reloading the trained
weights is shared code, tested on `z_image`, `sd3` and `flux`.)"""

import pytest
import torch

from mmgrpo.algorithms.flow_grpo import FlowGRPO, FlowGRPOConfig
from mmgrpo.pipelines.qwen_image import QwenImageConfig, QwenImagePolicy
from mmgrpo.plans import FlowPlan
from mmgrpo.types import PromptBatch
from algorithm_options import algo_config
from builders._weights import perturb

PROMPTS = ["a red circle", "two blue squares", "a green triangle left of a yellow circle"]


def make_policy(path, **overrides):
    options = dict(pretrained=path, resolution=32, num_steps=3, true_cfg_scale=2.0, lora_rank=4, lora_alpha=8,
                   max_sequence_length=32, weights_dtype="float32")
    return QwenImagePolicy(QwenImageConfig(**{**options, **overrides}))


def stock(path, lora=None):
    from diffusers import QwenImagePipeline

    pipe = QwenImagePipeline.from_pretrained(str(path))
    pipe.set_progress_bar_config(disable=True)
    if lora is not None:
        pipe.load_lora_weights(str(lora))
    return pipe


def stock_images(pipe, policy, steps, prompts=PROMPTS[:2], seed=2):
    c = policy.config
    negative = [c.negative_prompt] * len(prompts) if c.true_cfg_scale > 1 else None
    return pipe(prompt=list(prompts), negative_prompt=negative, true_cfg_scale=c.true_cfg_scale,
                num_inference_steps=steps, height=32, width=32, output_type="pt",
                generator=torch.Generator().manual_seed(seed), max_sequence_length=32).images.float()


def ours(policy, steps, prompts=PROMPTS[:2], seed=2):
    plan = FlowPlan.deterministic(steps)
    return policy.sample(PromptBatch(prompts), plan, generator=torch.Generator().manual_seed(seed)).outputs["images"]


@pytest.mark.parametrize("cfg", [2.0, 1.0], ids=["true-cfg", "no-cfg"])
def test_ode_sampling_equals_stock_pipeline(tiny_qwen_image_dir, tmp_path, cfg):
    policy = make_policy(tiny_qwen_image_dir, true_cfg_scale=cfg)
    perturb(policy, seed=1)
    policy.save_pretrained(str(tmp_path / "lora"))
    pipe = stock(tiny_qwen_image_dir, tmp_path / "lora")
    prompts = PROMPTS  # prompts of different lengths: padded text with a mask
    torch.testing.assert_close(ours(policy, 3, prompts), stock_images(pipe, policy, 3, prompts), rtol=0, atol=1e-4)
    torch.testing.assert_close(pipe.scheduler.sigmas, policy.sigmas(3), rtol=0, atol=0)


def test_sigmas_follow_the_dynamic_and_terminal_shift(tiny_qwen_image_dir):
    """linspace(1, 1/S, S), exponential shift with mu of the 8 x 8 = 64 packed tokens, stretched to end at 0.02."""
    import math

    from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift

    base = torch.linspace(1.0, 0.25, 4, dtype=torch.float64)
    mu = calculate_shift(64, 256, 8192, 0.5, 0.9)
    shifted = math.exp(mu) / (math.exp(mu) + (1 / base - 1))
    one_minus = 1 - shifted
    stretched = 1 - one_minus / ((1 - shifted[-1]) / (1 - 0.02))
    sigmas = make_policy(tiny_qwen_image_dir).sigmas(4)
    torch.testing.assert_close(sigmas[:-1].double(), stretched, rtol=0, atol=1e-6)
    assert sigmas[-2] == pytest.approx(0.02) and sigmas[-1] == 0


def test_replay_matches_rollout_and_minibatches(tiny_qwen_image_dir):
    policy = make_policy(tiny_qwen_image_dir, num_steps=4)
    plan = FlowGRPO(algo_config(FlowGRPOConfig, noise_level=0.9)).schedule(4)
    rollout = policy.sample(PromptBatch(PROMPTS).repeat(2), plan, generator=torch.Generator().manual_seed(1))
    assert rollout.trajectory["latents"].shape == (6, 5, 64, 16)
    with torch.no_grad():
        full = policy.log_prob(rollout, [0, 3]).log_prob
        sub = policy.log_prob(rollout.select(torch.tensor([4, 1])), [0, 3]).log_prob
    torch.testing.assert_close(full, rollout.old_log_probs[:, [0, 3]], rtol=0, atol=1e-5)
    torch.testing.assert_close(sub, rollout.old_log_probs[[4, 1]][:, [0, 3]], rtol=0, atol=1e-5)


@pytest.mark.parametrize("lora_rank, merge", [(4, True), (0, False)], ids=["lora-merged", "full"])
def test_export_loads_in_stock_pipeline_with_identical_outputs(tiny_qwen_image_dir, tmp_path, lora_rank, merge):
    from mmgrpo.export import LORA_FOLDER

    policy = make_policy(tiny_qwen_image_dir, lora_rank=lora_rank)
    perturb(policy, seed=4)
    policy.export_pretrained(str(tmp_path / "out"), merge_lora=merge)
    pipe = stock(tmp_path / "out", tmp_path / "out" / LORA_FOLDER if lora_rank and not merge else None)
    expected = ours(policy, 3)
    torch.testing.assert_close(stock_images(pipe, policy, 3), expected, rtol=0, atol=1e-4)
    assert not torch.allclose(stock_images(stock(tiny_qwen_image_dir), policy, 3), expected, atol=1e-3)


def test_config_errors_name_the_fix(tiny_qwen_image_dir):
    with pytest.raises(ValueError, match="multiple of 16"):
        QwenImageConfig(pretrained=tiny_qwen_image_dir, resolution=40)
    with pytest.raises(ValueError, match="true_cfg_scale"):
        QwenImageConfig(pretrained=tiny_qwen_image_dir, true_cfg_scale=0.5)
    with pytest.raises(ValueError, match="max_sequence_length"):
        QwenImageConfig(pretrained=tiny_qwen_image_dir, max_sequence_length=2048)


def test_real_config_carries_flow_factorys_recipe(monkeypatch):
    from pathlib import Path

    from mmgrpo import config as config_mod

    root = Path(__file__).resolve().parents[2]
    monkeypatch.chdir(root)
    cfg = config_mod.load(root / "configs" / "qwen_image_flow_grpo.yaml")
    pipe, algo = cfg.pipeline.options, cfg.algorithm.options
    assert cfg.pipeline.name == "qwen_image" and pipe.pretrained == "Qwen/Qwen-Image-2512"
    assert (pipe.resolution, pipe.num_steps, pipe.eval_num_steps, pipe.true_cfg_scale) == (512, 10, 28, 4.0)
    assert (pipe.negative_prompt, pipe.gradient_checkpointing, cfg.train.sharding) == (" ", True, "fsdp")
    assert (algo.sde.noise_level, algo.clip.clip_low, algo.kl.kl_beta) == (1.0, 1e-4, 0.0)
    assert (algo.sde_window_size, algo.sde_window_range) == (1, [1, 4])  # one SDE step drawn from steps 1-3
    assert (cfg.train.prompts_per_step, cfg.train.group_size, cfg.train.learning_rate) == (48, 16, 3e-4)


def test_gradient_checkpointing_gives_the_same_replay_and_gradient(tiny_qwen_image_dir):
    """``gradient_checkpointing`` recomputes the transformer's blocks in the backward pass: same log-probs, same
    gradients (same LoRA initialisation and perturbation for both policies)."""
    plan = FlowGRPO(FlowGRPOConfig()).schedule(3)
    results = []
    for checkpointing in (False, True):
        torch.manual_seed(0)  # the LoRA initialisation
        policy = make_policy(tiny_qwen_image_dir, gradient_checkpointing=checkpointing)
        perturb(policy, seed=5)
        rollout = policy.sample(PromptBatch(PROMPTS[:2]), plan, generator=torch.Generator().manual_seed(0))
        score = policy.log_prob(rollout, [0, 2]).log_prob
        score.sum().backward()
        # (the last block's text-stream layers do not reach the image: no gradient)
        results.append((score.detach(), [p.grad for p in policy.trainable_parameters()]))
    torch.testing.assert_close(results[0][0], results[1][0], rtol=0, atol=1e-6)
    assert any(g is not None for g in results[0][1])
    for plain, checkpointed in zip(results[0][1], results[1][1]):
        assert (plain is None) == (checkpointed is None)
        if plain is not None:
            torch.testing.assert_close(plain, checkpointed, rtol=1e-4, atol=1e-6)
