"""Tiny HunyuanVideo 1.5 pipeline (real diffusers / transformers classes, offline tokenizers) for tests.

[`tiny_hunyuan_video15_pipeline`] is complete: a 1-block `HunyuanVideo15Transformer3DModel` (diffusers' own test
sizes), an `AutoencoderKLHunyuanVideo15` compressing space by 4 and time by 2 (a 3-frame 16 x 16 clip has latents
`[4, 2, 4, 4]`), a 2-layer `Qwen2_5_VLTextModel` with the tokenizer of `_tokenizers.qwen_tokenizer`, a tiny
`T5EncoderModel` with the (file-less) `ByT5Tokenizer`, a `FlowMatchEulerDiscreteScheduler` (shift 7) and the
`ClassifierFreeGuidance` guider. It reloads with plain `HunyuanVideo15Pipeline.from_pretrained`.
"""

from __future__ import annotations

import pytest
import torch

from ._tokenizers import qwen_tokenizer


def tiny_hunyuan_video15_pipeline(*, guidance_scale: float = 3.0, num_layers: int = 1, seed: int = 0):
    """Builds a randomly initialised, tiny `HunyuanVideo15Pipeline` from real library classes, fully offline.

    Args:
        guidance_scale (`float`, defaults to 3.0): the guider's CFG scale (1 turns it off).
        num_layers (`int`, defaults to 1): transformer blocks (one refiner block).
        seed (`int`, defaults to 0): seed of the weight initialisation; the global torch RNG is left untouched.

    Returns:
        `diffusers.HunyuanVideo15Pipeline`
    """
    from diffusers import (
        AutoencoderKLHunyuanVideo15, FlowMatchEulerDiscreteScheduler, HunyuanVideo15Pipeline,
        HunyuanVideo15Transformer3DModel,
    )
    from diffusers.guiders import ClassifierFreeGuidance
    from transformers import ByT5Tokenizer, Qwen2_5_VLTextConfig, Qwen2_5_VLTextModel, T5Config, T5EncoderModel

    tokenizer = qwen_tokenizer()
    tokenizer_2 = ByT5Tokenizer()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        transformer = HunyuanVideo15Transformer3DModel(
            in_channels=9, out_channels=4, num_attention_heads=2, attention_head_dim=8, num_layers=num_layers,
            num_refiner_layers=1, mlp_ratio=2.0, patch_size=1, patch_size_t=1, text_embed_dim=16, text_embed_2_dim=32,
            image_embed_dim=12, rope_axes_dim=(2, 2, 4), target_size=16, task_type="t2v",
        )
        vae = AutoencoderKLHunyuanVideo15(
            in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(16, 16), layers_per_block=1,
            spatial_compression_ratio=4, temporal_compression_ratio=2, downsample_match_channel=False,
            upsample_match_channel=False,
        )
        text_encoder = Qwen2_5_VLTextModel(Qwen2_5_VLTextConfig(
            vocab_size=len(tokenizer), hidden_size=16, intermediate_size=16, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=2, rope_theta=1e6,
            rope_scaling={"mrope_section": [1, 1, 2], "rope_type": "default", "type": "default"},
        ))
        text_encoder_2 = T5EncoderModel(T5Config(
            vocab_size=len(tokenizer_2), d_model=32, d_kv=8, d_ff=37, num_layers=1, num_heads=4,
            relative_attention_num_buckets=8,
        ))
    for module in (transformer, vae, text_encoder, text_encoder_2):
        module.eval()
    return HunyuanVideo15Pipeline(
        text_encoder=text_encoder, tokenizer=tokenizer, transformer=transformer, vae=vae,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0), text_encoder_2=text_encoder_2, tokenizer_2=tokenizer_2,
        guider=ClassifierFreeGuidance(guidance_scale=guidance_scale),
    )


@pytest.fixture(scope="session")
def tiny_hunyuan_video15_dir(tmp_path_factory):
    """A tiny random HunyuanVideo 1.5 text-to-video pipeline written with `save_pretrained`."""
    path = tmp_path_factory.mktemp("tiny_hunyuan_video15")
    tiny_hunyuan_video15_pipeline().save_pretrained(path)
    return str(path)


def tiny_policy(path: str, **overrides):
    """A 3-step, 3-frame 16 x 16 LoRA policy (rank 4, CFG 3) on the tiny folder `path`, with 32 Qwen and 16 ByT5
    text tokens (the stock 1000 and 256 are padding the transformer masks); `overrides` change options."""
    from mmgrpo.pipelines.hunyuan_video15 import HunyuanVideo15Config, HunyuanVideo15Policy

    options = dict(pretrained=path, height=16, width=16, num_frames=3, num_steps=3, guidance_scale=3.0, lora_rank=4,
                   lora_alpha=8, weights_dtype="float32", max_sequence_length=32, glyph_max_length=16)
    return HunyuanVideo15Policy(HunyuanVideo15Config(**{**options, **overrides}))


def build_policy(request):
    """The tiny policy of [`tiny_policy`] on `tiny_hunyuan_video15_dir`."""
    return tiny_policy(request.getfixturevalue("tiny_hunyuan_video15_dir"))
