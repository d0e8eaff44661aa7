"""Tiny Z-Image pipeline (real diffusers / transformers classes, offline tokenizer) for tests.

[`tiny_z_image_pipeline`] is complete (a `Qwen3Model` text encoder with the tokenizer of `_tokenizers.qwen_tokenizer`,
a `ZImageTransformer2DModel`, an `AutoencoderKL`, a `FlowMatchEulerDiscreteScheduler`) and reloads with plain
`ZImagePipeline.from_pretrained`. ``turbo=True`` gives Z-Image-Turbo's scheduler (static shift 3, few steps, no CFG).
"""

from __future__ import annotations

import pytest
import torch

from ._diffusers import tiny_vae
from ._tokenizers import qwen_tokenizer


@pytest.fixture(scope="session")
def tiny_z_image_dir(tmp_path_factory):
    """A tiny random Z-Image pipeline (the base model's dynamic shift) written with `save_pretrained`."""
    path = tmp_path_factory.mktemp("tiny_z_image")
    tiny_z_image_pipeline(seed=0).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def tiny_z_image_turbo_dir(tmp_path_factory):
    """The same tiny weights with Z-Image-Turbo's scheduler (static shift 3), written with `save_pretrained`."""
    path = tmp_path_factory.mktemp("tiny_z_image_turbo")
    tiny_z_image_pipeline(seed=0, turbo=True).save_pretrained(path)
    return str(path)


def build_policy(request):
    """A 3-step, 32 x 32 LoRA policy on `tiny_z_image_dir` (CFG 2)."""
    from mmgrpo.pipelines.z_image import ZImageConfig, ZImagePolicy

    path = request.getfixturevalue("tiny_z_image_dir")
    return ZImagePolicy(ZImageConfig(pretrained=path, resolution=32, num_steps=3, guidance_scale=2.0, lora_rank=4,
                                     lora_alpha=8, max_sequence_length=32))


def tiny_z_image_pipeline(*, dim: int = 32, heads: int = 2, layers: int = 1, text_hidden_size: int = 32,
                          latent_channels: int = 4, sample_size: int = 32, turbo: bool = False, seed: int = 0):
    """Builds a randomly initialised, tiny `ZImagePipeline` from real library classes, fully offline.

    Args:
        dim (`int`, defaults to 32): transformer width; the head width ``dim // heads`` is split over the three
            rotary axes.
        heads (`int`, defaults to 2): transformer heads.
        layers (`int`, defaults to 1): main and refiner (noise / caption) blocks each.
        text_hidden_size (`int`, defaults to 32): width of the `Qwen3Model` text encoder (2 layers; the pipeline reads
            its second-to-last hidden states).
        latent_channels (`int`, defaults to 4): VAE latent channels.
        sample_size (`int`, defaults to 32): default image size in pixels; the VAE halves it once.
        turbo (`bool`, defaults to `False`): Z-Image-Turbo's scheduler (``shift=3``, no dynamic shifting) instead of
            the base model's resolution-dependent shift.
        seed (`int`, defaults to 0): seed of the weight initialisation; the global torch RNG is left untouched.

    Returns:
        `diffusers.ZImagePipeline`
    """
    from diffusers import FlowMatchEulerDiscreteScheduler, ZImagePipeline, ZImageTransformer2DModel
    from transformers import Qwen3Config, Qwen3Model

    tokenizer = qwen_tokenizer()
    head = dim // heads
    axes = [head // 4, head // 4, head - 2 * (head // 4)]
    text_config = Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=text_hidden_size, intermediate_size=2 * text_hidden_size,
        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=512,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        text_encoder = Qwen3Model(text_config)
        transformer = ZImageTransformer2DModel(
            all_patch_size=(2,), all_f_patch_size=(1,), in_channels=latent_channels, dim=dim, n_layers=layers,
            n_refiner_layers=layers, n_heads=heads, n_kv_heads=heads, cap_feat_dim=text_hidden_size, axes_dims=axes,
            axes_lens=[256, 64, 64],
        )
        vae = tiny_vae((8, 8), latent_channels, sample_size, shift_factor=0.1, scaling_factor=1.5)
    for module in (text_encoder, transformer, vae):
        module.eval()
    if turbo:  # Z-Image-Turbo's scheduler config
        scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=False)
    else:
        scheduler = FlowMatchEulerDiscreteScheduler(
            num_train_timesteps=1000, shift=6.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
            base_image_seq_len=256, max_image_seq_len=4096,
        )
    return ZImagePipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                          transformer=transformer)
