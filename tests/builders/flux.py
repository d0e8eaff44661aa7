"""Tiny FLUX pipeline (real diffusers / transformers classes, offline tokenizers) for tests.

[`tiny_flux_pipeline`] is complete (CLIP and T5, the T5 tokenizer built by `_tokenizers.t5_tokenizer`) and reloads
with plain `FluxPipeline.from_pretrained`.
"""

from __future__ import annotations

import pytest
import torch

from ._diffusers import tiny_clip_config, tiny_vae
from ._tokenizers import T5_WORDS, clip_tokenizer, t5_tokenizer


@pytest.fixture(scope="session")
def tiny_flux_dir(tmp_path_factory):
    """A tiny random FLUX pipeline written with `save_pretrained`."""
    path = tmp_path_factory.mktemp("tiny_flux")
    tiny_flux_pipeline(seed=0).save_pretrained(path)
    return str(path)


def build_policy(request):
    """A 3-step, 32 x 32 LoRA policy on `tiny_flux_dir`."""
    from mmgrpo.pipelines.flux import FluxConfig, FluxPolicy

    path = request.getfixturevalue("tiny_flux_dir")
    return FluxPolicy(FluxConfig(pretrained=path, resolution=32, num_steps=3, lora_rank=4, lora_alpha=8, max_sequence_length=16))


def tiny_flux_pipeline(
    *,
    num_layers: int = 1,
    num_single_layers: int = 1,
    attention_head_dim: int = 16,
    num_attention_heads: int = 2,
    axes_dims_rope: tuple[int, int, int] = (4, 4, 8),
    sample_size: int = 32,
    vae_channels: tuple[int, ...] = (8, 8),
    latent_channels: int = 4,
    text_hidden_size: int = 32,
    text_layers: int = 2,
    text_max_length: int = 16,
    guidance_embeds: bool = True,
    vocab_words: tuple[str, ...] = (),
    seed: int = 0,
):
    """Builds a randomly initialised, tiny `FluxPipeline` from real library classes, fully offline.

    Components as in FLUX.1-dev, scaled down: `CLIPTextModel` (pooled text vector) with the tokenizer of
    [`clip_tokenizer`], `T5EncoderModel` with the tokenizer of [`t5_tokenizer`], a `FluxTransformer2DModel` with the
    guidance embedding, an `AutoencoderKL` with FLUX-style ``shift_factor`` / ``scaling_factor`` and a
    `FlowMatchEulerDiscreteScheduler` with FLUX.1-dev's resolution-dependent (dynamic) shift. Latents are packed in
    2x2 patches, so the transformer's ``in_channels`` is ``4 * latent_channels``. All modules are in `eval()` mode;
    the same arguments and `seed` give the same weights, and the global torch RNG is left untouched.

    Args:
        num_layers (`int`, defaults to 1): double-stream (MM-DiT) blocks.
        num_single_layers (`int`, defaults to 1): single-stream blocks.
        attention_head_dim (`int`, defaults to 16): head width; must equal ``sum(axes_dims_rope)``.
        num_attention_heads (`int`, defaults to 2): transformer heads.
        axes_dims_rope (`tuple[int, int, int]`, defaults to `(4, 4, 8)`): rotary dimensions per position axis.
        sample_size (`int`, defaults to 32): default image size in pixels (height = width).
        vae_channels (`tuple[int, ...]`, defaults to `(8, 8)`): VAE block channels; ``len - 1`` halvings, so the
            default downsamples by 2 and a 32 px image becomes 16x16 latents, i.e. 8x8 = 64 packed tokens.
        latent_channels (`int`, defaults to 4): VAE latent channels.
        text_hidden_size (`int`, defaults to 32): width of both text encoders (CLIP's pooled vector and T5's states).
        text_layers (`int`, defaults to 2): layers of each text encoder.
        text_max_length (`int`, defaults to 16): CLIP token length.
        guidance_embeds (`bool`, defaults to `True`): FLUX.1-dev's distilled guidance embedding (schnell has none).
        vocab_words (`tuple[str, ...]`, *optional*): words both tokenizers keep whole (see [`clip_tokenizer`] and
            [`t5_tokenizer`]).
        seed (`int`, defaults to 0): seed of the weight initialisation.

    Returns:
        `diffusers.FluxPipeline`
    """
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextModel, T5Config, T5EncoderModel

    if sum(axes_dims_rope) != attention_head_dim:
        raise ValueError(f"sum(axes_dims_rope) {sum(axes_dims_rope)} must equal attention_head_dim {attention_head_dim}.")
    tokenizer = clip_tokenizer(model_max_length=text_max_length, extra_words=vocab_words)
    tokenizer_2 = t5_tokenizer(T5_WORDS + tuple(vocab_words)) if vocab_words else t5_tokenizer()
    clip_config = tiny_clip_config(tokenizer, text_hidden_size, text_layers, text_max_length)
    t5_config = T5Config(
        vocab_size=len(tokenizer_2),
        d_model=text_hidden_size,
        d_kv=8,
        d_ff=2 * text_hidden_size,
        num_layers=text_layers,
        num_heads=max(1, text_hidden_size // 8),
        relative_attention_num_buckets=8,
        pad_token_id=tokenizer_2.pad_token_id,
        eos_token_id=tokenizer_2.eos_token_id,
        decoder_start_token_id=tokenizer_2.pad_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        text_encoder = CLIPTextModel(clip_config)
        text_encoder_2 = T5EncoderModel(t5_config)
        transformer = FluxTransformer2DModel(
            patch_size=1,
            in_channels=4 * latent_channels,
            num_layers=num_layers,
            num_single_layers=num_single_layers,
            attention_head_dim=attention_head_dim,
            num_attention_heads=num_attention_heads,
            joint_attention_dim=text_hidden_size,  # T5 width
            pooled_projection_dim=text_hidden_size,  # CLIP pooled width
            guidance_embeds=guidance_embeds,
            axes_dims_rope=tuple(axes_dims_rope),
        )
        vae = tiny_vae(tuple(vae_channels), latent_channels, sample_size, shift_factor=0.1, scaling_factor=1.5)
    for module in (text_encoder, text_encoder_2, transformer, vae):
        module.eval()
    scheduler = FlowMatchEulerDiscreteScheduler(  # FLUX.1-dev's scheduler config
        shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15, base_image_seq_len=256,
        max_image_seq_len=4096,
    )
    return FluxPipeline(
        scheduler=scheduler,
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        text_encoder_2=text_encoder_2,
        tokenizer_2=tokenizer_2,
        transformer=transformer,
    )
