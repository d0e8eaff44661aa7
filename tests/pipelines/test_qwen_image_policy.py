"""The Qwen-Image adapter on real diffusers classes built from tiny configs (`builders/qwen_image.py`): ODE sampling
equals the stock `QwenImagePipeline` (true CFG with a negative prompt and its norm rescale, or none), the noise levels
are the stock ones (dynamic and terminal shift), replay reproduces the rollout's log-probabilities, LoRA and full
exports load back in the stock pipeline, gradient checkpointing changes nothing. (Saving and reloading the trained
weights is shared code, tested on `z_image`, `sd3` and `flux`.)"""

import pytest
import torch

from mmgrpo.pipelines.qwen_image import QwenImageConfig, QwenImagePolicy
from builders._stock_equality import (
    PROMPTS, StockAdapter, check_export, check_gradient_checkpointing, check_ode_sampling, check_replay,
    load_flow_factory_config, load_stock,
)


def make_policy(path, **overrides):
    options = dict(pretrained=path, resolution=32, num_steps=3, true_cfg_scale=2.0, lora_rank=4, lora_alpha=8,
                   max_sequence_length=32, weights_dtype="float32")
    return QwenImagePolicy(QwenImageConfig(**{**options, **overrides}))


def stock(path, lora=None):
    from diffusers import QwenImagePipeline

    return load_stock(QwenImagePipeline, path, lora)


def stock_images(pipe, policy, steps, prompts=PROMPTS[:2], seed=2):
    c = policy.config
    negative = [c.negative_prompt] * len(prompts) if c.true_cfg_scale > 1 else None
    return pipe(prompt=list(prompts), negative_prompt=negative, true_cfg_scale=c.true_cfg_scale,
                num_inference_steps=steps, height=32, width=32, output_type="pt",
                generator=torch.Generator().manual_seed(seed), max_sequence_length=32).images.float()


ADAPTER = StockAdapter(make_policy, stock, stock_images)


@pytest.mark.parametrize("cfg", [2.0, 1.0], ids=["true-cfg", "no-cfg"])
def test_ode_sampling_equals_stock_pipeline(tiny_qwen_image_dir, tmp_path, cfg):
    policy = make_policy(tiny_qwen_image_dir, true_cfg_scale=cfg)
    # prompts of different lengths: padded text with a mask
    check_ode_sampling(ADAPTER, policy, tiny_qwen_image_dir, 3, tmp_path, prompts=PROMPTS)


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
    check_replay(make_policy(tiny_qwen_image_dir, num_steps=4), (6, 5, 64, 16))


@pytest.mark.parametrize("lora_rank, merge", [(4, True), (0, False)], ids=["lora-merged", "full"])
def test_export_loads_in_stock_pipeline_with_identical_outputs(tiny_qwen_image_dir, tmp_path, lora_rank, merge):
    check_export(ADAPTER, tiny_qwen_image_dir, tmp_path, lora_rank, merge)


def test_config_errors_name_the_fix(tiny_qwen_image_dir):
    with pytest.raises(ValueError, match="multiple of 16"):
        QwenImageConfig(pretrained=tiny_qwen_image_dir, resolution=40)
    with pytest.raises(ValueError, match="true_cfg_scale"):
        QwenImageConfig(pretrained=tiny_qwen_image_dir, true_cfg_scale=0.5)
    with pytest.raises(ValueError, match="max_sequence_length"):
        QwenImageConfig(pretrained=tiny_qwen_image_dir, max_sequence_length=2048)


def test_real_config_carries_flow_factorys_recipe(monkeypatch):
    cfg = load_flow_factory_config(monkeypatch, "qwen_image_flow_grpo", noise_level=1.0)
    pipe = cfg.pipeline.options
    assert cfg.pipeline.name == "qwen_image" and pipe.pretrained == "Qwen/Qwen-Image-2512"
    assert (pipe.resolution, pipe.num_steps, pipe.eval_num_steps, pipe.true_cfg_scale) == (512, 10, 28, 4.0)
    assert (pipe.negative_prompt, pipe.gradient_checkpointing, cfg.train.sharding) == (" ", True, "fsdp")


def test_gradient_checkpointing_gives_the_same_replay_and_gradient(tiny_qwen_image_dir):
    check_gradient_checkpointing(make_policy, tiny_qwen_image_dir)
