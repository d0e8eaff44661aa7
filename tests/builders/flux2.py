"""Tiny FLUX.2 [klein] pipeline (real diffusers / transformers classes, offline tokenizer) for tests.

[`tiny_flux2_klein_pipeline`] is complete (a `Qwen3ForCausalLM` text encoder with the tokenizer of
`_tokenizers.qwen_tokenizer`, a `Flux2Transformer2DModel` without guidance embedding, an `AutoencoderKLFlux2` whose
batch-norm statistics are set to non-trivial values, a `FlowMatchEulerDiscreteScheduler`) and reloads with plain
`Flux2KleinPipeline.from_pretrained`. ``distilled=True`` marks it step-distilled (``is_distilled``: no CFG, few
steps) as FLUX.2 [klein] 4B / 9B are. The text encoder has 2 layers: the policy and the stock pipeline read
``text_encoder_out_layers`` [`OUT_LAYERS`] instead of the real models' (9, 18, 27).
"""

from __future__ import annotations

import pytest
import torch

from ._tokenizers import qwen_tokenizer

OUT_LAYERS = [1, 2, 2]  # hidden states of the 2-layer text encoder stacked into the text embedding


@pytest.fixture(scope="session")
def tiny_flux2_dir(tmp_path_factory):
    """A tiny random FLUX.2 [klein] base pipeline (CFG) written with `save_pretrained`."""
    path = tmp_path_factory.mktemp("tiny_flux2")
    tiny_flux2_klein_pipeline(seed=0).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def tiny_flux2_distilled_dir(tmp_path_factory):
    """The same tiny weights marked step-distilled (``is_distilled``), written with `save_pretrained`."""
    path = tmp_path_factory.mktemp("tiny_flux2_distilled")
    tiny_flux2_klein_pipeline(seed=0, distilled=True).save_pretrained(path)
    return str(path)


def build_policy(request):
    """A 3-step, 32 x 32 LoRA policy on `tiny_flux2_dir` with CFG 2."""
    from mmgrpo.pipelines.flux2 import Flux2Config, Flux2Policy

    path = request.getfixturevalue("tiny_flux2_dir")
    return Flux2Policy(Flux2Config(pretrained=path, resolution=32, num_steps=3, guidance_scale=2.0, lora_rank=4,
                                   lora_alpha=8, max_sequence_length=32, text_encoder_out_layers=OUT_LAYERS,
                                   weights_dtype="float32"))


def tiny_flux2_klein_pipeline(*, heads: int = 2, head_dim: int = 16, text_hidden_size: int = 32,
                              latent_channels: int = 4, distilled: bool = False, seed: int = 0):
    """Builds a randomly initialised, tiny `Flux2KleinPipeline` from real library classes, fully offline.

    Args:
        heads (`int`, defaults to 2): transformer heads.
        head_dim (`int`, defaults to 16): head width, split over the four rotary axes.
        text_hidden_size (`int`, defaults to 32): width of the 2-layer `Qwen3ForCausalLM`; the transformer reads
            ``3 * text_hidden_size`` (three stacked hidden states).
        latent_channels (`int`, defaults to 4): VAE latent channels; latents are patchified 2x2, so the transformer
            reads ``4 * latent_channels``.
        distilled (`bool`, defaults to `False`): register the pipeline as step-distilled (``is_distilled``).
        seed (`int`, defaults to 0): seed of the weight initialisation; the global torch RNG is left untouched.

    Returns:
        `diffusers.Flux2KleinPipeline`: its VAE halves the image size once, so a 32 px image has 8 x 8 tokens.
    """
    from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Flux2KleinPipeline, Flux2Transformer2DModel
    from transformers import Qwen3Config, Qwen3ForCausalLM

    tokenizer = qwen_tokenizer()
    text_config = Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=text_hidden_size, intermediate_size=2 * text_hidden_size,
        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=512,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=True,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        text_encoder = Qwen3ForCausalLM(text_config)
        transformer = Flux2Transformer2DModel(
            patch_size=1, in_channels=4 * latent_channels, num_layers=1, num_single_layers=1, attention_head_dim=head_dim,
            num_attention_heads=heads, joint_attention_dim=3 * text_hidden_size, timestep_guidance_channels=32,
            mlp_ratio=2.0, axes_dims_rope=(head_dim // 4,) * 4, guidance_embeds=False,
        )
        vae = AutoencoderKLFlux2(
            down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
            block_out_channels=(8, 8), layers_per_block=1, latent_channels=latent_channels, norm_num_groups=4,
            sample_size=32, use_quant_conv=False, use_post_quant_conv=False, mid_block_add_attention=False,
        )
        vae.bn.running_mean.normal_(0.0, 0.2)  # the latents' batch-norm statistics the pipeline undoes
        vae.bn.running_var.uniform_(0.5, 2.0)
    for module in (text_encoder, transformer, vae):
        module.eval()
    scheduler = FlowMatchEulerDiscreteScheduler(  # FLUX.2's scheduler config
        num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
        base_image_seq_len=256, max_image_seq_len=4096, time_shift_type="exponential",
    )
    return Flux2KleinPipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                              transformer=transformer, is_distilled=distilled)
