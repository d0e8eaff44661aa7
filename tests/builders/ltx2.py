"""Tiny LTX-2 pipeline (real diffusers / transformers classes, offline tokenizer) for tests.

[`tiny_ltx2_pipeline`] is complete: a 1-block audio-video `LTX2VideoTransformer3DModel`, the `LTX2TextConnectors`, a
2-layer `Gemma3ForConditionalGeneration` text encoder (with a 1-layer vision tower the pipeline never calls) and the
byte-level BPE of `_tokenizers.qwen_tokenizer`, an `AutoencoderKLLTX2Video` (space / 2, time / 2 with the causal
first frame: a 5-frame 32 x 32 clip has latents `[4, 3, 16, 16]`), an `AutoencoderKLLTX2Audio` with an `LTX2Vocoder`
(diffusers' own test sizes), and LTX-2's `FlowMatchEulerDiscreteScheduler` (dynamic shift on the video token count).
It reloads with plain `LTX2Pipeline.from_pretrained`.
"""

from __future__ import annotations

import pytest
import torch

from ._tokenizers import qwen_tokenizer


def tiny_ltx2_pipeline(*, num_layers: int = 1, seed: int = 0):
    """Builds a randomly initialised, tiny `LTX2Pipeline` from real library classes, fully offline.

    Args:
        num_layers (`int`, defaults to 1): transformer blocks.
        seed (`int`, defaults to 0): seed of the weight initialisation; the global torch RNG is left untouched.

    Returns:
        `diffusers.LTX2Pipeline`
    """
    from diffusers import (
        AutoencoderKLLTX2Audio, AutoencoderKLLTX2Video, FlowMatchEulerDiscreteScheduler, LTX2Pipeline,
        LTX2VideoTransformer3DModel,
    )
    from diffusers.pipelines.ltx2 import LTX2TextConnectors
    from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3TextConfig, SiglipVisionConfig

    tokenizer = qwen_tokenizer()
    width = 32  # the text encoder's hidden size, also the connectors' and the transformer's caption width
    text = Gemma3TextConfig(
        vocab_size=len(tokenizer), hidden_size=width, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, max_position_embeddings=256, sliding_window=64,
        pad_token_id=tokenizer.pad_token_id,
    )
    vision = SiglipVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                image_size=16, patch_size=8)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        text_encoder = Gemma3ForConditionalGeneration(Gemma3Config(
            text_config=text.to_dict(), vision_config=vision.to_dict(), mm_tokens_per_image=4,
            image_token_index=len(tokenizer) - 1, boi_token_index=len(tokenizer) - 2, eoi_token_index=len(tokenizer) - 3,
        ))
        transformer = LTX2VideoTransformer3DModel(
            in_channels=4, out_channels=4, patch_size=1, patch_size_t=1, num_attention_heads=2, attention_head_dim=8,
            cross_attention_dim=16, audio_in_channels=4, audio_out_channels=4, audio_num_attention_heads=2,
            audio_attention_head_dim=4, audio_cross_attention_dim=8, num_layers=num_layers,
            qk_norm="rms_norm_across_heads", caption_channels=width, rope_double_precision=False, rope_type="split",
        )
        connectors = LTX2TextConnectors(
            caption_channels=width, text_proj_in_factor=text.num_hidden_layers + 1,
            video_connector_num_attention_heads=4, video_connector_attention_head_dim=8, video_connector_num_layers=1,
            video_connector_num_learnable_registers=None, audio_connector_num_attention_heads=4,
            audio_connector_attention_head_dim=8, audio_connector_num_layers=1,
            audio_connector_num_learnable_registers=None, connector_rope_base_seq_len=32, rope_theta=10000.0,
            rope_double_precision=False, causal_temporal_positioning=False, rope_type="split",
        )
        vae = AutoencoderKLLTX2Video(
            in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(8,), decoder_block_out_channels=(8,),
            layers_per_block=(1,), decoder_layers_per_block=(1, 1), spatio_temporal_scaling=(True,),
            decoder_spatio_temporal_scaling=(True,), decoder_inject_noise=(False, False), downsample_type=("spatial",),
            upsample_residual=(False,), upsample_factor=(1,), timestep_conditioning=False, patch_size=1,
            patch_size_t=1, encoder_causal=True, decoder_causal=False,
        )
        audio_vae = AutoencoderKLLTX2Audio(
            base_channels=4, output_channels=2, ch_mult=(1,), num_res_blocks=1, attn_resolutions=None, in_channels=2,
            resolution=32, latent_channels=2, norm_type="pixel", causality_axis="height", dropout=0.0,
            mid_block_add_attention=False, sample_rate=16000, mel_hop_length=160, is_causal=True, mel_bins=8,
        )
        vocoder = LTX2Vocoder(
            in_channels=2 * 8, hidden_channels=32, out_channels=2, upsample_kernel_sizes=[4, 4],
            upsample_factors=[2, 2], resnet_kernel_sizes=[3], resnet_dilations=[[1, 3, 5]],
            leaky_relu_negative_slope=0.1, output_sampling_rate=16000,
        )
    for module in (text_encoder, transformer, connectors, vae, audio_vae, vocoder):
        module.eval()
    scheduler = FlowMatchEulerDiscreteScheduler(  # LTX-2's: shift by mu of the video token count
        use_dynamic_shifting=True, base_shift=0.95, max_shift=2.05, base_image_seq_len=1024, max_image_seq_len=4096,
        shift_terminal=0.1,
    )
    return LTX2Pipeline(scheduler=scheduler, vae=vae, audio_vae=audio_vae, text_encoder=text_encoder,
                        tokenizer=tokenizer, connectors=connectors, transformer=transformer, vocoder=vocoder)


@pytest.fixture(scope="session")
def tiny_ltx2_dir(tmp_path_factory):
    """A tiny random LTX-2 text-to-audio-video pipeline written with `save_pretrained`."""
    path = tmp_path_factory.mktemp("tiny_ltx2")
    tiny_ltx2_pipeline().save_pretrained(path)
    return str(path)


def tiny_policy(path: str, **overrides):
    """A 3-step, 5-frame 32 x 32 LoRA policy (rank 4, CFG 3 on video and audio) with 16 text tokens on the tiny folder
    `path`; `overrides` change options."""
    from mmgrpo.pipelines.ltx2 import LTX2Config, LTX2Policy

    options = dict(pretrained=path, height=32, width=32, num_frames=5, frame_rate=25.0, num_steps=3,
                   guidance_scale=3.0, audio_guidance_scale=3.0, max_sequence_length=16, lora_rank=4, lora_alpha=8,
                   weights_dtype="float32")
    return LTX2Policy(LTX2Config(**{**options, **overrides}))


def build_policy(request):
    """The tiny policy of [`tiny_policy`] on `tiny_ltx2_dir`."""
    return tiny_policy(request.getfixturevalue("tiny_ltx2_dir"))
