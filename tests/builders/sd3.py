"""Tiny Stable Diffusion 3 pipeline (real diffusers / transformers classes, offline tokenizer) for tests and the
shipped base model (`scripts/train_t2i_shapes.py`).

The pipeline is made of the real library classes (`CLIPTextModelWithProjection` x2, `SD3Transformer2DModel`,
`AutoencoderKL`, `FlowMatchEulerDiscreteScheduler`) with random weights and no T5 encoder. Without T5 the SD3
pipeline appends `max_sequence_length` all-zero text tokens to the CLIP tokens, and its default is 256: pass
``max_sequence_length=TEXT_PAD_LENGTH`` to the tiny test pipelines, and the value stored in ``metrics.json``
(``["sampling"]["max_sequence_length"]``) to the shipped ``weights/t2i_shapes`` model. A pipeline saved without T5
reloads with [`load_sd3_pipeline`] (plain `from_pretrained` refuses it).
"""

from __future__ import annotations

from typing import Iterable

import pytest
import torch

from ._diffusers import tiny_clip_config, tiny_vae
from ._tokenizers import clip_tokenizer

# Zero "T5" tokens appended to the CLIP tokens by the tiny test pipelines (`max_sequence_length`).
TEXT_PAD_LENGTH = 16


@pytest.fixture(scope="session")
def tiny_sd3_dir(tmp_path_factory):
    """A tiny random SD3 pipeline written with `save_pretrained`."""
    path = tmp_path_factory.mktemp("tiny_sd3")
    tiny_sd3_pipeline(seed=0).save_pretrained(path)
    return str(path)


def build_policy(request):
    """A 3-step, 32 x 32 LoRA policy on `tiny_sd3_dir`."""
    from mmgrpo.pipelines.sd3 import SD3Config, SD3Policy

    path = request.getfixturevalue("tiny_sd3_dir")
    return SD3Policy(SD3Config(pretrained=path, resolution=32, num_steps=3, guidance_scale=1.0, lora_rank=4,
                               max_sequence_length=TEXT_PAD_LENGTH))


def tiny_sd3_pipeline(
    *,
    num_layers: int = 2,
    attention_head_dim: int = 8,
    num_attention_heads: int = 4,
    sample_size: int = 32,
    vae_downsample: int = 2,
    vae_channels: tuple[int, ...] = (8, 8),
    latent_channels: int = 4,
    patch_size: int = 2,
    text_hidden_size: int = 32,
    text_layers: int = 2,
    text_projection_dim: int = 32,
    text_max_length: int = 16,
    n_merges: int = 486,
    vocab_words: Iterable[str] = (),
    scheduler_shift: float = 1.0,
    seed: int = 0,
):
    """Builds a randomly initialised, tiny `StableDiffusion3Pipeline` from real library classes, fully offline.

    Both CLIP text encoders share the tokenizer built by [`clip_tokenizer`]; there is no T5 encoder
    (``text_encoder_3=None``). All modules are in `eval()` mode (a module built from a config starts in training
    mode). The same arguments and `seed` always give the same weights, and the global torch RNG is left untouched.

    Args:
        num_layers (`int`, defaults to 2): transformer blocks.
        attention_head_dim (`int`, defaults to 8): transformer head width; hidden size is heads x head width.
        num_attention_heads (`int`, defaults to 4): transformer heads.
        sample_size (`int`, defaults to 32): default image size in pixels (height = width).
        vae_downsample (`int`, defaults to 2): spatial downsampling of the VAE, a power of 2 (1, 2, 4, ...).
        vae_channels (`tuple[int, ...]`, defaults to `(8, 8)`): channels of the VAE blocks; repeated or cut to
            ``log2(vae_downsample) + 1`` blocks.
        latent_channels (`int`, defaults to 4): VAE latent channels (= transformer input channels).
        patch_size (`int`, defaults to 2): transformer patch size on the latent grid.
        text_hidden_size (`int`, defaults to 32): width of each CLIP text encoder.
        text_layers (`int`, defaults to 2): layers of each CLIP text encoder.
        text_projection_dim (`int`, defaults to 32): CLIP projection size; the pooled text vector is twice it.
        text_max_length (`int`, defaults to 16): CLIP token length (`tokenizer.model_max_length`).
        n_merges (`int`, defaults to 486): BPE merges kept by the tokenizer.
        vocab_words (`Iterable[str]`, *optional*): words the tokenizer keeps whole (see [`clip_tokenizer`]).
        scheduler_shift (`float`, defaults to 1.0): `shift` of the flow-matching scheduler.
        seed (`int`, defaults to 0): seed of the weight initialisation.

    Returns:
        `diffusers.StableDiffusion3Pipeline`: call it with ``max_sequence_length=TEXT_PAD_LENGTH``.
    """
    from diffusers import (
        FlowMatchEulerDiscreteScheduler,
        SD3Transformer2DModel,
        StableDiffusion3Pipeline,
    )
    from transformers import CLIPTextModelWithProjection

    n_blocks = vae_downsample.bit_length()
    if vae_downsample < 1 or 2 ** (n_blocks - 1) != vae_downsample:
        raise ValueError(f"`vae_downsample` must be a power of 2 (1, 2, 4, 8...), got {vae_downsample}.")
    if sample_size % (vae_downsample * patch_size):
        raise ValueError(
            f"`sample_size` ({sample_size}) must be divisible by vae_downsample x patch_size "
            f"({vae_downsample} x {patch_size}); change one of them."
        )
    channels = tuple(vae_channels[min(i, len(vae_channels) - 1)] for i in range(n_blocks))
    latent_size = sample_size // vae_downsample

    tokenizer = clip_tokenizer(n_merges=n_merges, model_max_length=text_max_length, extra_words=vocab_words)
    clip_config = tiny_clip_config(tokenizer, text_hidden_size, text_layers, text_max_length, text_projection_dim)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        text_encoder = CLIPTextModelWithProjection(clip_config)
        text_encoder_2 = CLIPTextModelWithProjection(clip_config)
        transformer = SD3Transformer2DModel(
            sample_size=latent_size,
            patch_size=patch_size,
            in_channels=latent_channels,
            out_channels=latent_channels,
            num_layers=num_layers,
            attention_head_dim=attention_head_dim,
            num_attention_heads=num_attention_heads,
            # the pipeline zero-pads the concatenated CLIP states (2 x hidden) to this width
            joint_attention_dim=2 * text_hidden_size,
            caption_projection_dim=attention_head_dim * num_attention_heads,
            pooled_projection_dim=2 * text_projection_dim,
            pos_embed_max_size=latent_size // patch_size,
        )
        vae = tiny_vae(channels, latent_channels, sample_size, shift_factor=0.0, scaling_factor=1.0)
    for module in (text_encoder, text_encoder_2, transformer, vae):
        module.eval()
    return StableDiffusion3Pipeline(
        transformer=transformer,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=scheduler_shift),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        text_encoder_2=text_encoder_2,
        tokenizer_2=tokenizer,
        text_encoder_3=None,
        tokenizer_3=None,
    )


def load_sd3_pipeline(path: str, **kwargs):
    """Loads a `StableDiffusion3Pipeline` saved with `save_pretrained`, including one saved without T5.

    `StableDiffusion3Pipeline.from_pretrained` refuses a folder whose ``model_index.json`` lists
    ``text_encoder_3``/``tokenizer_3`` as null unless they are passed explicitly as `None`; this does it.

    Args:
        path (`str`): local pipeline folder (with ``model_index.json``).
        kwargs: passed on to `from_pretrained` (e.g. `dtype`).
    """
    from diffusers import StableDiffusion3Pipeline

    from mmgrpo.hub import load_diffusers_pipeline

    return load_diffusers_pipeline(StableDiffusion3Pipeline, path, **kwargs)
