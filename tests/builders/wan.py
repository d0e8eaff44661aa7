"""Tiny Wan pipelines (real diffusers / transformers classes, offline tokenizer) for tests.

[`tiny_wan_pipeline`] builds diffusers' own test sizes of `WanTransformer3DModel` and `AutoencoderKLWan` (spatial
compression 8, temporal 4, patch (1, 2, 2): a 5-frame 32 x 32 clip has latents `[16, 2, 4, 4]`), a 2-layer
`UMT5EncoderModel` and Wan's `UniPCMultistepScheduler` (flow sigmas, shift 3). Variants: Wan 2.2 A14B's two experts
(``boundary_ratio``), Wan 2.2 TI2V's per-token timesteps (``expand_timesteps``) and an I2V transformer that takes the
image condition as extra channels. Each reloads with plain `WanPipeline.from_pretrained` (the I2V one with
`WanImageToVideoPipeline`).
"""

from __future__ import annotations

import pytest
import torch

from ._tokenizers import t5_tokenizer

WAN_TOKENS = 16  # UMT5 tokens of the tiny policies (max_sequence_length)


def tiny_wan_pipeline(
    *,
    two_experts: bool = False,
    boundary_ratio: float = 0.9,
    expand_timesteps: bool = False,
    image_to_video: bool = False,
    scheduler: str = "unipc",
    num_layers: int = 2,
    seed: int = 0,
):
    """Builds a randomly initialised, tiny Wan pipeline from real library classes, fully offline.

    Args:
        two_experts (`bool`): add ``transformer_2`` (another random transformer) and ``boundary_ratio`` (Wan 2.2
            A14B).
        boundary_ratio (`float`): the expert switch with `two_experts` (``transformer`` for ``t >= 1000 ratio``).
        expand_timesteps (`bool`): Wan 2.2 TI2V's per-token timesteps (a first-frame-conditioned model with
            `image_to_video`).
        image_to_video (`bool`): a `WanImageToVideoPipeline`; without `expand_timesteps` its transformer takes
            ``2 * 16 + 4`` input channels (latents, first-frame mask, image latents), as Wan 2.2 I2V.
        scheduler (`str`): ``"unipc"`` (Wan's own, flow sigmas with shift 3) or ``"euler"`` (flow-matching Euler with
            shift 3, which `WanPipeline` runs exactly as our ODE step).
        num_layers (`int`): transformer blocks.
        seed (`int`): seed of the weight initialisation (the global RNG is left untouched).

    Returns:
        `diffusers.WanPipeline` or `diffusers.WanImageToVideoPipeline`
    """
    from diffusers import (
        AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, UniPCMultistepScheduler, WanImageToVideoPipeline,
        WanPipeline, WanTransformer3DModel,
    )
    from transformers import UMT5Config, UMT5EncoderModel

    tokenizer = t5_tokenizer(model_max_length=WAN_TOKENS)
    concat = image_to_video and not expand_timesteps
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        text_encoder = UMT5EncoderModel(UMT5Config(
            vocab_size=len(tokenizer), d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
            relative_attention_num_buckets=8, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0,
        ))
        vae = AutoencoderKLWan(
            base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True]
        )

        def transformer():
            return WanTransformer3DModel(
                patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=36 if concat else 16,
                out_channels=16, text_dim=32, freq_dim=256, ffn_dim=32, num_layers=num_layers, cross_attn_norm=True,
                qk_norm="rms_norm_across_heads", rope_max_seq_len=32,
            )

        transformers = {"transformer": transformer()}
        if two_experts:
            transformers["transformer_2"] = transformer()
    if scheduler == "unipc":
        sched = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0)
    else:
        sched = FlowMatchEulerDiscreteScheduler(shift=3.0)
    for module in (text_encoder, vae, *transformers.values()):
        module.eval()
    cls = WanImageToVideoPipeline if image_to_video else WanPipeline
    extra = {"image_encoder": None, "image_processor": None} if image_to_video else {}
    return cls(
        tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, scheduler=sched, **transformers, **extra,
        boundary_ratio=boundary_ratio if two_experts else None, expand_timesteps=expand_timesteps,
    )


def _save(tmp_path_factory, name: str, **options) -> str:
    path = tmp_path_factory.mktemp(name)
    tiny_wan_pipeline(**options).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def tiny_wan_dir(tmp_path_factory):
    """A tiny random Wan 2.1-style text-to-video pipeline written with `save_pretrained`."""
    return _save(tmp_path_factory, "tiny_wan")


@pytest.fixture(scope="session")
def tiny_wan_experts_dir(tmp_path_factory):
    """Wan 2.2 A14B-style: two experts switching at ``boundary_ratio = 0.9`` (Euler scheduler)."""
    return _save(tmp_path_factory, "tiny_wan_experts", two_experts=True, scheduler="euler")


@pytest.fixture(scope="session")
def tiny_wan_ti2v_dir(tmp_path_factory):
    """Wan 2.2 TI2V-style: per-token timesteps (``expand_timesteps``), first-frame conditioning (Euler scheduler)."""
    return _save(tmp_path_factory, "tiny_wan_ti2v", expand_timesteps=True, image_to_video=True, scheduler="euler")


@pytest.fixture(scope="session")
def tiny_wan_i2v_dir(tmp_path_factory):
    """Wan 2.2 I2V-style: the image condition as extra input channels, no image encoder (Euler scheduler)."""
    return _save(tmp_path_factory, "tiny_wan_i2v", image_to_video=True, scheduler="euler")


@pytest.fixture(scope="session")
def tiny_wan_euler_dir(tmp_path_factory):
    """The text-to-video pipeline with a flow-matching Euler scheduler (our ODE step is its update)."""
    return _save(tmp_path_factory, "tiny_wan_euler", scheduler="euler")


def tiny_policy(path: str, **overrides):
    """A 3-step, 5-frame 32 x 32 LoRA policy (rank 4) on the tiny Wan folder `path`; `overrides` change options."""
    from mmgrpo.pipelines.wan import WanConfig, WanPolicy

    options = dict(pretrained=path, height=32, width=32, num_frames=5, num_steps=3, guidance_scale=1.0, lora_rank=4,
                   lora_alpha=8, max_sequence_length=WAN_TOKENS)
    return WanPolicy(WanConfig(**{**options, **overrides}))


def build_policy(request):
    """The tiny policy of [`tiny_policy`] on `tiny_wan_dir`."""
    return tiny_policy(request.getfixturevalue("tiny_wan_dir"))
