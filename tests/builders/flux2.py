"""Tiny FLUX.2 [klein] pipeline (real diffusers / transformers classes, offline tokenizer) for tests.

[`tiny_flux2_klein_pipeline`] is complete (a `Qwen3ForCausalLM` text encoder with the tokenizer of
`_tokenizers.qwen_tokenizer`, a `Flux2Transformer2DModel` without guidance embedding, an `AutoencoderKLFlux2` whose
batch-norm statistics are set to non-trivial values, a `FlowMatchEulerDiscreteScheduler`) and reloads with plain
`Flux2KleinPipeline.from_pretrained`; [`tiny_flux2_dev_pipeline`] is a tiny FLUX.2 [dev]. ``distilled=True`` marks it step-distilled (``is_distilled``: no CFG, few
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
def tiny_flux2_dev_dir(tmp_path_factory):
    """A tiny random FLUX.2 [dev] pipeline (Mistral-3 text encoder, guidance embedding) written with `save_pretrained`."""
    path = tmp_path_factory.mktemp("tiny_flux2_dev")
    tiny_flux2_dev_pipeline(seed=0).save_pretrained(path)
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


def tiny_flux2_klein_pipeline(*, text_hidden_size: int = 32, distilled: bool = False, seed: int = 0):
    """Builds a randomly initialised, tiny `Flux2KleinPipeline` from real library classes, fully offline.

    Args:
        text_hidden_size (`int`, defaults to 32): width of the 2-layer `Qwen3ForCausalLM`; the transformer reads
            ``3 * text_hidden_size`` (three stacked hidden states).
        distilled (`bool`, defaults to `False`): register the pipeline as step-distilled (``is_distilled``).
        seed (`int`, defaults to 0): seed of the weight initialisation; the global torch RNG is left untouched.

    Returns:
        `diffusers.Flux2KleinPipeline`: its VAE halves the image size once, so a 32 px image has 8 x 8 tokens.
    """
    from diffusers import Flux2KleinPipeline
    from transformers import Qwen3Config, Qwen3ForCausalLM

    tokenizer = qwen_tokenizer()
    text_config = Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=text_hidden_size, intermediate_size=2 * text_hidden_size,
        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=512,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=True,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        text_encoder = Qwen3ForCausalLM(text_config).eval()
        parts = _image_parts(3 * text_hidden_size, guidance_embeds=False)
    return Flux2KleinPipeline(text_encoder=text_encoder, tokenizer=tokenizer, is_distilled=distilled, **parts)


def tiny_flux2_dev_pipeline(*, text_hidden_size: int = 32, seed: int = 0):
    """Builds a randomly initialised, tiny `Flux2Pipeline` (FLUX.2 [dev]: a `Mistral3ForConditionalGeneration` text
    encoder, a transformer with the distilled guidance embedding), fully offline. The tokenizer is
    `_tokenizers.qwen_tokenizer` (its chat template reads the pipeline's system / user messages) with FLUX.2's system
    message learnt, so prompts fit in 64 tokens; the same sizes and seed as [`tiny_flux2_klein_pipeline`]."""
    from diffusers import Flux2Pipeline
    from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    tokenizer = qwen_tokenizer(extra_words=[SYSTEM_MESSAGE] * 4)
    config = Mistral3Config(
        text_config=dict(model_type="mistral", vocab_size=len(tokenizer), hidden_size=text_hidden_size,
                         intermediate_size=2 * text_hidden_size, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=16, max_position_embeddings=512,
                         pad_token_id=tokenizer.pad_token_id),
        vision_config=dict(model_type="pixtral", hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                           num_attention_heads=2, head_dim=8, image_size=32, patch_size=8),
        image_token_index=tokenizer.convert_tokens_to_ids("<|image_pad|>"),
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        text_encoder = Mistral3ForConditionalGeneration(config).eval()
        parts = _image_parts(3 * text_hidden_size, guidance_embeds=True)
    return Flux2Pipeline(text_encoder=text_encoder, tokenizer=tokenizer, **parts)


def _image_parts(text_width: int, guidance_embeds: bool, latent_channels: int = 4, heads: int = 2, head_dim: int = 16):
    """The transformer (1 double- and 1 single-stream block reading text of `text_width`), the VAE (one halving, its
    latent batch-norm statistics set to non-trivial values) and FLUX.2's scheduler, in eval mode."""
    from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Flux2Transformer2DModel

    transformer = Flux2Transformer2DModel(
        patch_size=1, in_channels=4 * latent_channels, num_layers=1, num_single_layers=1, attention_head_dim=head_dim,
        num_attention_heads=heads, joint_attention_dim=text_width, timestep_guidance_channels=32, mlp_ratio=2.0,
        axes_dims_rope=(head_dim // 4,) * 4, guidance_embeds=guidance_embeds,
    ).eval()
    vae = AutoencoderKLFlux2(
        down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
        block_out_channels=(8, 8), layers_per_block=1, latent_channels=latent_channels, norm_num_groups=4,
        sample_size=32, use_quant_conv=False, use_post_quant_conv=False, mid_block_add_attention=False,
    ).eval()
    vae.bn.running_mean.normal_(0.0, 0.2)  # the latents' batch-norm statistics the pipeline undoes
    vae.bn.running_var.uniform_(0.5, 2.0)
    scheduler = FlowMatchEulerDiscreteScheduler(  # FLUX.2's scheduler config
        num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
        base_image_seq_len=256, max_image_seq_len=4096, time_shift_type="exponential",
    )
    return {"transformer": transformer, "vae": vae, "scheduler": scheduler}
