"""Parts shared by the tiny diffusers pipelines of `builders/` (a CLIP text-encoder config, a small VAE)."""

from __future__ import annotations


def tiny_clip_config(tokenizer, hidden_size: int, layers: int, max_length: int, projection_dim: int | None = None):
    """A small `CLIPTextConfig` for `tokenizer` (with a projection when `projection_dim` is given)."""
    from transformers import CLIPTextConfig

    extra = {} if projection_dim is None else {"projection_dim": projection_dim}
    return CLIPTextConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_attention_heads=max(1, hidden_size // 16),
        num_hidden_layers=layers,
        max_position_embeddings=max_length,
        hidden_act="gelu",
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **extra,
    )


def tiny_vae(channels: tuple[int, ...], latent_channels: int, sample_size: int, shift_factor: float, scaling_factor: float):
    """A small `AutoencoderKL`: one block per entry of `channels`, ``len(channels) - 1`` halvings of the size."""
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * len(channels),
        up_block_types=("UpDecoderBlock2D",) * len(channels),
        block_out_channels=channels,
        layers_per_block=1,
        latent_channels=latent_channels,
        norm_num_groups=min(4, min(channels)),
        sample_size=sample_size,
        use_quant_conv=False,
        use_post_quant_conv=False,
        mid_block_add_attention=False,
        shift_factor=shift_factor,
        scaling_factor=scaling_factor,
    )
