"""Tiny Qwen-Image pipeline (real diffusers / transformers classes, offline tokenizer) for tests.

[`tiny_qwen_image_pipeline`] is complete (a `Qwen2_5_VLForConditionalGeneration` text encoder from
`builders/qwen_vl.py` with a tokenizer that also learnt Qwen-Image's prompt template, a `QwenImageTransformer2DModel`,
an `AutoencoderKLQwenImage`, a `FlowMatchEulerDiscreteScheduler` with Qwen-Image's dynamic shift) and reloads with
plain `QwenImagePipeline.from_pretrained`.
"""

from __future__ import annotations

import pytest
import torch

from ._tokenizers import qwen_tokenizer

# the system prompt of QwenImagePipeline's template, learnt by the tiny tokenizer so the prompts stay short
TEMPLATE_TEXT = ("Describe the image by detailing the color, shape, size, texture, quantity, text, spatial relationships "
                 "of the objects and background:")


@pytest.fixture(scope="session")
def tiny_qwen_image_dir(tmp_path_factory):
    """A tiny random Qwen-Image pipeline written with `save_pretrained`."""
    path = tmp_path_factory.mktemp("tiny_qwen_image")
    tiny_qwen_image_pipeline(seed=0).save_pretrained(path)
    return str(path)


def build_policy(request):
    """A 3-step, 32 x 32 LoRA policy on `tiny_qwen_image_dir` with true CFG 2."""
    from mmgrpo.pipelines.qwen_image import QwenImageConfig, QwenImagePolicy

    path = request.getfixturevalue("tiny_qwen_image_dir")
    return QwenImagePolicy(QwenImageConfig(pretrained=path, resolution=32, num_steps=3, true_cfg_scale=2.0, lora_rank=4,
                                           lora_alpha=8, max_sequence_length=32, weights_dtype="float32"))


def tiny_qwen_image_pipeline(*, heads: int = 2, head_dim: int = 16, layers: int = 1, text_hidden_size: int = 64,
                             latent_channels: int = 4, seed: int = 0):
    """Builds a randomly initialised, tiny `QwenImagePipeline` from real library classes, fully offline.

    Args:
        heads (`int`, defaults to 2): transformer heads.
        head_dim (`int`, defaults to 16): head width, split over the three rotary axes.
        layers (`int`, defaults to 1): dual-stream transformer blocks.
        text_hidden_size (`int`, defaults to 64): width of the tiny Qwen2.5-VL language model (2 layers).
        latent_channels (`int`, defaults to 4): VAE latent channels; latents are packed in 2x2 patches, so the
            transformer reads ``4 * latent_channels``.
        seed (`int`, defaults to 0): seed of the weight initialisation; the global torch RNG is left untouched.

    Returns:
        `diffusers.QwenImagePipeline`: its VAE halves the image size once, so a 32 px image has 8 x 8 packed tokens.
    """
    from diffusers import (AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImagePipeline,
                           QwenImageTransformer2DModel)

    from .qwen_vl import tiny_qwen_vl  # here, not at import: pytest registers builders.qwen_vl as a plugin after this

    tokenizer = qwen_tokenizer(extra_words=[TEMPLATE_TEXT] * 4)
    axes = (head_dim // 4, head_dim // 4 + (head_dim // 4) % 2, 0)
    axes = (axes[0], axes[1], head_dim - axes[0] - axes[1])
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        text_encoder, _ = tiny_qwen_vl("qwen2_5_vl", seed=seed, hidden_size=text_hidden_size, tokenizer=tokenizer)
        transformer = QwenImageTransformer2DModel(
            patch_size=2, in_channels=4 * latent_channels, out_channels=latent_channels, num_layers=layers,
            attention_head_dim=head_dim, num_attention_heads=heads, joint_attention_dim=text_hidden_size,
            axes_dims_rope=axes,
        )
        vae = AutoencoderKLQwenImage(
            base_dim=8, z_dim=latent_channels, dim_mult=[1, 2], num_res_blocks=1, temperal_downsample=[False],
            latents_mean=[0.1 * i for i in range(latent_channels)], latents_std=[1.0 + 0.2 * i for i in range(latent_channels)],
        )
    for module in (text_encoder, transformer, vae):
        module.eval()
    scheduler = FlowMatchEulerDiscreteScheduler(  # Qwen-Image's scheduler config
        num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=0.9,
        base_image_seq_len=256, max_image_seq_len=8192, shift_terminal=0.02, time_shift_type="exponential",
    )
    return QwenImagePipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                             transformer=transformer)
