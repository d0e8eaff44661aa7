"""Offline tokenizers (CLIP, T5) and tiny-but-real Stable Diffusion 3 and FLUX pipeline builders (no hub access,
deterministic).

The SD3 pipeline is made of the real library classes (`CLIPTextModelWithProjection` x2, `SD3Transformer2DModel`,
`AutoencoderKL`, `FlowMatchEulerDiscreteScheduler`) with random weights and no T5 encoder. Without T5 the SD3
pipeline appends `max_sequence_length` all-zero text tokens to the CLIP tokens, and its default is 256: pass
``max_sequence_length=TEXT_PAD_LENGTH`` to the tiny test pipelines, and the value stored in ``metrics.json``
(``["sampling"]["max_sequence_length"]``) to the shipped ``weights/t2i_shapes`` model. A pipeline saved without T5
reloads with [`load_sd3_pipeline`] (plain `from_pretrained` refuses it).

The FLUX pipeline ([`tiny_flux_pipeline`]) is complete (CLIP and T5, the T5 tokenizer built by [`t5_tokenizer`]) and
reloads with plain `FluxPipeline.from_pretrained`.
"""

from __future__ import annotations

import functools
import gzip
from typing import Iterable

import torch

# Zero "T5" tokens appended to the CLIP tokens by the tiny test pipelines (`max_sequence_length`).
TEXT_PAD_LENGTH = 16


def _bpe_merges_used(word: str, ranks: dict[tuple[str, str], int]) -> set[tuple[str, str]]:
    """The merges that CLIP's BPE applies (lowest rank first) to turn `word` into its final tokens."""
    parts = list(word[:-1]) + [word[-1] + "</w>"]
    used = set()
    while len(parts) > 1:
        pairs = [(ranks.get((a, b), float("inf")), i) for i, (a, b) in enumerate(zip(parts, parts[1:]))]
        rank, i = min(pairs)
        if rank == float("inf"):
            break
        used.add((parts[i], parts[i + 1]))
        parts[i : i + 2] = [parts[i] + parts[i + 1]]
    return used


@functools.lru_cache(maxsize=1)
def _clip_bpe_merges() -> tuple[str, ...]:
    """All 48894 merges of open_clip's bundled CLIP BPE file, in rank order."""
    import open_clip.tokenizer

    with gzip.open(open_clip.tokenizer.default_bpe()) as f:
        lines = f.read().decode("utf-8").split("\n")
    return tuple(lines[1 : 49152 - 256 - 2 + 1])


def clip_tokenizer(n_merges: int = 486, model_max_length: int = 16, extra_words: Iterable[str] = ()):
    """Builds a CLIP BPE tokenizer in memory from the BPE file bundled with `open_clip`.

    Keeping only the first `n_merges` merges gives a small vocabulary of ``512 + n_merges + 2`` tokens (1000 by
    default) whose ids agree with the real CLIP tokenizer for the kept tokens. No file or network access.
    With `extra_words`, the merges that full CLIP applies to those (lower-case ASCII) words are kept as well, so
    each of them tokenizes exactly as in full CLIP (usually as a single token); their ids come after the first
    `n_merges` merges.

    Args:
        n_merges (`int`, defaults to 486): number of BPE merges kept (at most 48894).
        model_max_length (`int`, defaults to 16): padded/truncated length of the token sequences.
        extra_words (`Iterable[str]`, *optional*): words whose full-CLIP tokenization must be preserved.

    Returns:
        `transformers.CLIPTokenizer`: with ``<|startoftext|>`` as bos and ``<|endoftext|>`` as eos and pad.
    """
    import open_clip.tokenizer
    from transformers import CLIPTokenizer

    all_merges = _clip_bpe_merges()
    merges = list(all_merges[:n_merges])
    extra_words = sorted(set(extra_words))
    if extra_words:
        ranks = {tuple(m.split()): i for i, m in enumerate(all_merges)}
        used = set().union(*(_bpe_merges_used(w, ranks) for w in extra_words))
        merges += [m for m in all_merges[n_merges:] if tuple(m.split()) in used]  # keeps the rank order
    byte_vocab = list(open_clip.tokenizer.bytes_to_unicode().values())
    vocab = byte_vocab + [v + "</w>" for v in byte_vocab] + ["".join(m.split()) for m in merges]
    vocab += ["<|startoftext|>", "<|endoftext|>"]
    return CLIPTokenizer(
        vocab={token: i for i, token in enumerate(vocab)},
        merges=[tuple(m.split()) for m in merges],
        model_max_length=model_max_length,
    )



def _tiny_clip_config(tokenizer, hidden_size: int, layers: int, max_length: int, projection_dim: int | None = None):
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


def _tiny_vae(channels: tuple[int, ...], latent_channels: int, sample_size: int, shift_factor: float, scaling_factor: float):
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
    clip_config = _tiny_clip_config(tokenizer, text_hidden_size, text_layers, text_max_length, text_projection_dim)
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
        vae = _tiny_vae(channels, latent_channels, sample_size, shift_factor=0.0, scaling_factor=1.0)
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


# Words the hand-built T5 vocabulary keeps whole (everything else falls back to single characters).
T5_WORDS: tuple[str, ...] = (
    "a", "an", "the", "of", "and", "with", "in", "on", "photo", "picture", "image", "cat", "dog", "red", "green",
    "blue", "yellow", "cyan", "magenta", "circle", "circles", "square", "squares", "triangle", "triangles", "one",
    "two", "three", "four", "left", "right", "above", "below",
)
_T5_CHARACTERS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,;:!?'\"-()"


def t5_tokenizer(words: Iterable[str] = T5_WORDS, model_max_length: int = 16):
    """Builds a small T5 (Unigram) tokenizer in memory, deterministically and without any file or network access.

    The vocabulary is ``<pad>`` (0), ``</s>`` (1), ``<unk>`` (2), then each of `words` as a whole piece (``▁word``),
    the bare word boundary ``▁`` and single ASCII characters, so any ASCII prompt tokenizes (unknown words letter by
    letter). Trained Unigram vocabularies are not reproducible from run to run; this one is.

    Args:
        words (`Iterable[str]`, *optional*): words kept as single tokens (order-insensitive).
        model_max_length (`int`, defaults to 16): default padded/truncated length.

    Returns:
        `transformers.T5Tokenizer`: with ``<pad>`` as pad and ``</s>`` as eos; no ``<extra_id_*>`` tokens.
    """
    from transformers import T5Tokenizer

    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)]
    pieces += [("\u2581" + w, -1.0) for w in sorted(set(words))]
    pieces += [("\u2581", -3.0)] + [(c, -5.0) for c in _T5_CHARACTERS]
    return T5Tokenizer(vocab=pieces, extra_ids=0, model_max_length=model_max_length)


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
        seed (`int`, defaults to 0): seed of the weight initialisation.

    Returns:
        `diffusers.FluxPipeline`
    """
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextModel, T5Config, T5EncoderModel

    if sum(axes_dims_rope) != attention_head_dim:
        raise ValueError(f"sum(axes_dims_rope) {sum(axes_dims_rope)} must equal attention_head_dim {attention_head_dim}.")
    tokenizer = clip_tokenizer(model_max_length=text_max_length)
    tokenizer_2 = t5_tokenizer()
    clip_config = _tiny_clip_config(tokenizer, text_hidden_size, text_layers, text_max_length)
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
        vae = _tiny_vae(tuple(vae_channels), latent_channels, sample_size, shift_factor=0.1, scaling_factor=1.5)
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
