"""LTX-2 text-to-video (joint audio-video rectified flow) as a stochastic policy, with LoRA and CFG; video output only.

Wraps diffusers' `LTX2Pipeline` components (`LTX2VideoTransformer3DModel`, `LTX2TextConnectors`, the Gemma 3 text
encoder, `AutoencoderKLLTX2Video`, `AutoencoderKLLTX2Audio`, `FlowMatchEulerDiscreteScheduler`). LTX-2 denoises video
and audio latents together (each attends to the other), so the policy's state is both: the packed video tokens
`[N, Sv, Cv]` and audio tokens `[N, Sa, Ca]`, flattened and concatenated per sample (`[N, Sv Cv + Sa Ca]`); a step's
log-density covers both, as the sampled transition does. Only the video is decoded (``{"videos": [N, F, 3, H, W]}``);
the audio latents are sampled, not decoded, and no reward sees them.

What is LTX-2's own, as the stock pipeline does it: Gemma 3's hidden states of every layer stacked, passed through the
text connectors into a video and an audio context (one padding mask); the transformer's timestep ``1000 sigma`` (also
as its ``sigma``), the video positions at ``frame_rate``, the audio positions of ``round(F / frame_rate x sample_rate
/ hop / t_audio)`` latent frames; CFG per modality, ``v_c + (s - 1)(v_c - v_u)`` (the stock pipeline's x0-space
delta, the same rule on velocities) with ``guidance_scale`` on the video and ``audio_guidance_scale`` on the audio.
Noise levels are the stock ``linspace(1, 1/S, S)`` shifted with ``mu`` of the video token count, then 0.

Not implemented: the stock pipeline's spatio-temporal guidance (``stg_scale``), modality-isolation guidance
(``modality_scale``) and guidance rescaling, which its defaults turn on; the policy samples as the stock pipeline
called with ``stg_scale=0, modality_scale=1, guidance_rescale=0`` (and the audio counterparts). Model:
https://github.com/Lightricks/LTX-2 ; report: https://arxiv.org/abs/2601.03233
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch

from mmgrpo.pipelines._flow_common import check_flow_config, guided
from mmgrpo.pipelines import _flow_policy as flow_policy
from mmgrpo.pipelines._flow_policy import load_flow_pipeline
from mmgrpo.samplers.flow_plan import PLAN_FEATURES, SCORE_FIELDS
from mmgrpo.validation import check_range

TEXT_KEYS = ("video_embeds", "audio_embeds", "mask")  # the connectors' two contexts and their mask


@dataclass
class LTX2Config:
    """Options of [`LTX2Policy`]; names and meanings are `LTX2Pipeline.__call__`'s.

    Args:
        pretrained (`str`): a diffusers LTX-2 folder or a hub id (e.g. ``Lightricks/LTX-2``).
        height (`int`), width (`int`): frame size in pixels, multiples of the VAE's spatial compression (32).
        num_frames (`int`): frames per clip, ``1 mod t`` for the VAE's temporal compression `t` (8): 9, 17, ... 121.
        frame_rate (`float`): frames per second; sets the video positions and the audio length.
        num_steps (`int`): denoising steps for training rollouts.
        eval_num_steps (`int`, *optional*): denoising steps for evaluation (default: `num_steps`).
        guidance_scale (`float`): CFG on the video velocity; 1 turns CFG off (one forward per step) when
            `audio_guidance_scale` is 1 too.
        audio_guidance_scale (`float`): CFG on the audio velocity (the stock default 7).
        negative_prompt (`str`): the unconditional prompt used with CFG.
        max_sequence_length (`int`): Gemma tokens (stock 1024).
        use_cross_timestep (`bool`): the transformer's cross-modal timestep conditioning (the stock default).
        lora_rank (`int`): LoRA rank on the transformer; 0 trains the whole transformer.
        lora_alpha (`int`): LoRA scaling numerator.
        lora_targets (`list[str]`): transformer module names (suffixes) that get LoRA; the defaults are the video
            stream's attention and MLP (``attn1``, ``attn2``, ``ff``; the ``audio_*`` modules keep their weights).
        weights_dtype (`str`): dtype of the frozen components (text encoder, connectors, VAEs, and the base transformer
            under LoRA). Trainable parameters are always float32.
        gradient_checkpointing (`bool`): recompute each transformer block in the backward pass.
        offload (`bool`): keep the rollout's latents and text embeddings on the CPU between sampling and training.
    """

    pretrained: str
    height: int = 512
    width: int = 768
    num_frames: int = 121
    frame_rate: float = 24.0
    num_steps: int = 10
    eval_num_steps: int | None = None
    guidance_scale: float = 3.0
    audio_guidance_scale: float = 7.0
    negative_prompt: str = ""
    max_sequence_length: int = 1024
    use_cross_timestep: bool = True
    lora_rank: int = 64
    lora_alpha: int = 128
    lora_targets: list[str] = field(
        default_factory=lambda: [
            "attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0",
            "attn2.to_q", "attn2.to_k", "attn2.to_v", "attn2.to_out.0", "ff.net.0.proj", "ff.net.2",
        ]
    )
    weights_dtype: Literal["float32", "bfloat16", "float16"] = "bfloat16"
    gradient_checkpointing: bool = False
    offload: bool = False

    def __post_init__(self):
        check_flow_config(self, max_tokens=4096)
        check_range("guidance_scale", self.guidance_scale, 1, fix="1 disables CFG")
        check_range("audio_guidance_scale", self.audio_guidance_scale, 1, 100, fix="1 disables the audio's CFG")
        check_range("frame_rate", self.frame_rate, 1, 240, fix="LTX-2 is trained at 24-50 fps")
        check_range("height", self.height, 1, 4096, fix="a multiple of 32")
        check_range("width", self.width, 1, 4096, fix="a multiple of 32")
        check_range("num_frames", self.num_frames, 1, 1024, fix="1 mod 8, e.g. 121")

    def output_size(self) -> tuple[int, str]:
        """Bytes of one sample's decoded clip (float32 RGB), and the keys that set them (for the preflight)."""
        keys = "pipeline.num_frames, pipeline.height or pipeline.width"
        return self.num_frames * 3 * self.height * self.width * 4, keys


class LTX2Policy:
    """LTX-2 sampler as a policy: `sample` draws SDE/ODE trajectories of the joint latents `[N, Sv Cv + Sa Ca]`
    (the trajectory keeps ``latents`` `[N, S + 1, D]` and the text contexts once per prompt), `log_prob` replays their
    transitions, `likelihood` scores the final latents; outputs ``videos`` `[N, F, 3, H, W]` in [0, 1]. Set-up,
    sampling, replay and checkpoints are shared with the other flow adapters (at the end of the class)."""

    Config = LTX2Config
    modalities = frozenset({"video"})
    plan_families = ("flow",)
    plan_features = PLAN_FEATURES
    provides = SCORE_FIELDS
    capabilities = frozenset({"chunked_rollouts"})
    input_names = ("prompt_index", *(f"shared_{k}" for k in TEXT_KEYS), *(f"shared_negative_{k}" for k in TEXT_KEYS))

    def __init__(self, config: LTX2Config):
        from diffusers import LTX2Pipeline

        self.config = config
        self.flow = load_flow_pipeline(LTX2Pipeline, config, offload=config.offload)
        self.pipe = pipe = self.flow.pipe
        self._check_size()
        c = config
        self.video_grid = ((c.num_frames - 1) // pipe.vae_temporal_compression_ratio + 1,
                           c.height // pipe.vae_spatial_compression_ratio, c.width // pipe.vae_spatial_compression_ratio)
        rate = pipe.audio_sampling_rate / pipe.audio_hop_length / float(pipe.audio_vae_temporal_compression_ratio)
        self.audio_frames = round(c.num_frames / c.frame_rate * rate)
        self.mel_bins = pipe.audio_vae.config.mel_bins // pipe.audio_vae_mel_compression_ratio
        self.trainable = self.flow.experts[0]
        self.transformer = self.trainable.module
        self.device = torch.device("cpu")

    def _check_size(self) -> None:
        """Frames ``1 mod t`` and sides multiples of the VAE's spatial compression times the patch."""
        c, pipe = self.config, self.pipe
        t, side = pipe.vae_temporal_compression_ratio, pipe.vae_spatial_compression_ratio
        side *= pipe.transformer_spatial_patch_size
        if (c.num_frames - 1) % (t * pipe.transformer_temporal_patch_size):
            raise ValueError(f"pipeline.num_frames must be 1 mod {t} (the VAE's temporal compression); got "
                             f"{c.num_frames}: use {c.num_frames - (c.num_frames - 1) % t} or "
                             f"{c.num_frames - (c.num_frames - 1) % t + t}.")
        for name, size in (("height", c.height), ("width", c.width)):
            if size % side:
                raise ValueError(f"pipeline.{name} must be a multiple of {side} (VAE spatial compression x patch) "
                                 f"for {c.pretrained}; got {size}.")

    # ------------------------------------------------------------------------------------------------------ model
    def sigmas(self, num_steps: int) -> torch.Tensor:
        """The stock sigmas `[num_steps + 1]`: ``linspace(1, 1/S, S)`` shifted with ``mu`` of the video token count
        (where the scheduler shifts dynamically), then 0."""
        import numpy as np
        from diffusers.pipelines.ltx2.pipeline_ltx2 import calculate_shift, retrieve_timesteps

        scheduler = self.pipe.scheduler
        config = scheduler.config
        tokens = self.video_grid[0] * self.video_grid[1] * self.video_grid[2]
        mu = calculate_shift(tokens, config.get("base_image_seq_len", 1024), config.get("max_image_seq_len", 4096),
                             config.get("base_shift", 0.95), config.get("max_shift", 2.05))
        retrieve_timesteps(scheduler, num_steps, "cpu", sigmas=np.linspace(1.0, 1 / num_steps, num_steps), mu=mu)
        return scheduler.sigmas.float().clone()  # [S + 1]

    @property
    def do_cfg(self) -> bool:
        return self.config.guidance_scale > 1 or self.config.audio_guidance_scale > 1

    @torch.no_grad()
    def _encode_text(self, texts: list[str]) -> dict[str, torch.Tensor]:
        """The connectors' video context `[n, L, Dv]`, audio context `[n, L, Da]` and mask `[n, L]` of `texts`."""
        pipe = self.pipe
        embeds, mask, _, _ = pipe.encode_prompt(prompt=list(texts), do_classifier_free_guidance=False,
                                                max_sequence_length=self.config.max_sequence_length, device=self.device)
        return dict(zip(TEXT_KEYS, pipe.connectors(embeds, mask, padding_side=pipe.tokenizer.padding_side)))

    # text inputs computed once per distinct prompt (`_encode_text`), picked per sample
    encode, _pick = flow_policy.DISTINCT_PROMPTS
    _inputs = encode  # the model inputs of a prompt batch, for the shared sampling

    def _split(self, latents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Joint latents `[n, Sv Cv + Sa Ca]` -> packed video `[n, Sv, Cv]` and audio `[n, Sa, Ca]` tokens."""
        n, video_size = latents.shape[0], self.video_grid[0] * self.video_grid[1] * self.video_grid[2]
        channels = self.transformer.config.in_channels
        video, audio = latents.split([video_size * channels, latents.shape[1] - video_size * channels], dim=1)
        return video.reshape(n, video_size, channels), audio.reshape(n, self.audio_frames, -1)

    def velocity(self, latents: torch.Tensor, sigma, picked: dict, guidance: bool = True) -> torch.Tensor:
        """Joint velocity `[n, D]` in float32 for joint latents `[n, D]` at noise level `sigma`; CFG per modality
        unless ``guidance=False`` (the conditional velocity)."""
        cfg = self.do_cfg and guidance
        c, dtype = self.config, self.transformer.dtype
        text = [picked[k] for k in TEXT_KEYS]
        if cfg:  # unconditional first, as `guided` reads them
            text = [torch.cat([picked[f"negative_{k}"], t]) for k, t in zip(TEXT_KEYS, text)]
        video, audio = (torch.cat([x, x]) if cfg else x for x in self._split(latents))  # [b, Sv, Cv], [b, Sa, Ca]
        b = video.shape[0]
        rope = self.transformer
        t = (torch.as_tensor(sigma, dtype=torch.float32) * self.pipe.scheduler.config.num_train_timesteps)
        t = t.to(self.device).expand(b)
        v_video, v_audio = self.trainable.forward(
            hidden_states=video.to(dtype), audio_hidden_states=audio.to(dtype), encoder_hidden_states=text[0],
            audio_encoder_hidden_states=text[1], timestep=t, sigma=t, encoder_attention_mask=text[2],
            audio_encoder_attention_mask=text[2], num_frames=self.video_grid[0], height=self.video_grid[1],
            width=self.video_grid[2], fps=c.frame_rate, audio_num_frames=self.audio_frames,
            video_coords=rope.rope.prepare_video_coords(b, *self.video_grid, self.device, fps=c.frame_rate),
            audio_coords=rope.audio_rope.prepare_audio_coords(b, self.audio_frames, self.device),
            use_cross_timestep=c.use_cross_timestep, return_dict=False,
        )
        v_video, v_audio = v_video.float(), v_audio.float()  # [b, Sv, Cv], [b, Sa, Ca]
        if cfg:
            v_video, v_audio = guided(v_video, c.guidance_scale), guided(v_audio, c.audio_guidance_scale)
        return torch.cat([v_video.flatten(1), v_audio.flatten(1)], dim=1)  # [n, D]

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Joint latents `[N, D]` -> videos `[N, F, 3, H, W]` in [0, 1] (the audio part is not decoded)."""
        pipe, vae = self.pipe, self.pipe.vae
        video = pipe._unpack_latents(self._split(latents.to(self.device))[0], *self.video_grid,
                                     pipe.transformer_spatial_patch_size, pipe.transformer_temporal_patch_size)
        video = pipe._denormalize_latents(video, vae.latents_mean, vae.latents_std, vae.config.scaling_factor)
        # a timestep-conditioned VAE decodes at the stock decode_timestep 0 (its noise scale 0 leaves the latents)
        timestep = video.new_zeros(video.shape[0]) if vae.config.timestep_conditioning else None
        frames = vae.decode(video.to(vae.dtype), timestep, return_dict=False)[0]  # [N, 3, F, H, W] in [-1, 1]
        return (frames.float() / 2 + 0.5).clamp(0, 1).transpose(1, 2).cpu()  # [N, F, 3, H, W]

    def _outputs(self, latents: torch.Tensor, inputs: dict) -> dict[str, torch.Tensor]:
        return {"videos": self.decode(latents)}  # [N, F, 3, H, W]

    def _noise(self, count: int, generator: torch.Generator | None) -> torch.Tensor:
        """Initial joint latents `[count, D]`, standard normal, drawn on the CPU in the stock order (the video's
        `[count, Cv, F', h, w]`, then the audio's `[count, Ca, Sa, M]`), packed as the pipeline packs them."""
        pipe = self.pipe
        video = torch.randn((count, self.transformer.config.in_channels, *self.video_grid), generator=generator)
        audio = torch.randn((count, pipe.audio_vae.config.latent_channels, self.audio_frames, self.mel_bins),
                            generator=generator)
        video = pipe._pack_latents(video, pipe.transformer_spatial_patch_size, pipe.transformer_temporal_patch_size)
        audio = pipe._pack_audio_latents(audio)  # [count, Sa, Ca M]
        return torch.cat([video.flatten(1), audio.flatten(1)], dim=1).to(self.device)  # [count, D]

    # ------------------------------------------------------------------------- shared with every flow adapter
    num_steps, eval_num_steps, trainable_parameters, trainable_modules, prepare, reference = flow_policy.SETUP
    sample, log_prob, likelihood = flow_policy.SAMPLING
    save_pretrained, load_trainable, export_pretrained = flow_policy.CHECKPOINTS


PLUGIN = LTX2Policy
