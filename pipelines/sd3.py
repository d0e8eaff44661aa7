"""Stable Diffusion 3 / 3.5 (MM-DiT, rectified flow) as a stochastic policy, with LoRA and optional CFG.

Wraps diffusers' `StableDiffusion3Pipeline` components (`SD3Transformer2DModel`, `AutoencoderKL`, CLIP and T5 text
encoders, `FlowMatchEulerDiscreteScheduler`); the adapter owns only the denoising loop, whose steps are taken by
[`mmgrpo.samplers.flow_sde.flow_sde_step`]. Paper: https://arxiv.org/abs/2403.03206
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch

from mmgrpo.model_limits import RESOLUTION_LIMIT, check_limit, find_int, read_json
from mmgrpo.pipelines._flow_common import check_flow_config, decode_images, guided, image_bytes
from mmgrpo.pipelines import _flow_policy as flow_policy
from mmgrpo.pipelines._flow_policy import load_flow_pipeline
from mmgrpo.samplers.flow_plan import PLAN_FEATURES, SCORE_FIELDS


@dataclass
class SD3Config:
    """Options of [`SD3Policy`].

    Args:
        pretrained (`str`): a diffusers SD3 folder, a hub id, or ``mmgrpo:<name>`` for a shipped toy model.
        resolution (`int`): image height and width in pixels.
        num_steps (`int`): denoising steps for training rollouts.
        eval_num_steps (`int`, *optional*): denoising steps for evaluation (default: `num_steps`).
        guidance_scale (`float`): classifier-free guidance; 1.0 turns CFG off (one forward per step).
        negative_prompt (`str`): the unconditional prompt used with CFG.
        max_sequence_length (`int`): T5 tokens.
        lora_rank (`int`): LoRA rank on the transformer; 0 trains the whole transformer.
        lora_alpha (`int`): LoRA scaling numerator.
        lora_targets (`list[str]`): transformer module names that get LoRA.
        weights_dtype (`str`): dtype of the frozen components (text encoders, VAE, and the base transformer
            under LoRA). Trainable parameters are always float32.
        gradient_checkpointing (`bool`): recompute each transformer block in the backward pass (same gradients,
            activations of one block at a time, about one more forward of the transformer per backward).
    """

    pretrained: str
    resolution: int = 512
    num_steps: int = 10
    eval_num_steps: int | None = None
    guidance_scale: float = 4.5
    negative_prompt: str = ""
    max_sequence_length: int = 256
    lora_rank: int = 32
    lora_alpha: int = 64
    lora_targets: list[str] = field(
        default_factory=lambda: [
            "attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0",
            "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out",
        ]
    )
    weights_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    gradient_checkpointing: bool = False

    def __post_init__(self):
        location, transformer = check_flow_config(self, max_tokens=512)  # diffusers' SD3 caps T5 at 512 tokens
        if self.resolution <= 0 or self.resolution % 8:
            raise ValueError(f"resolution must be a positive multiple of 8, got {self.resolution}.")
        positions, patch = find_int(transformer, "pos_embed_max_size"), find_int(transformer, "patch_size")
        vae = len(read_json(location, "vae/config.json").get("block_out_channels", [])) or None
        side = positions * patch * 2 ** (vae - 1) if positions and patch and vae else None  # pixels of the widest image
        check_limit("resolution", self.resolution, 8, side, RESOLUTION_LIMIT,
                    "pos_embed_max_size x patch_size x the VAE's downsampling")
        if self.guidance_scale < 1:
            raise ValueError(f"guidance_scale must be >= 1 (1 disables CFG), got {self.guidance_scale}.")

    def output_size(self) -> tuple[int, str]:
        """Bytes of one sample's decoded image, and the keys that set them (the memory check of
        [`~mmgrpo.preflight.preflight`] reads it)."""
        return image_bytes(self.resolution), "pipeline.resolution"


class SD3Policy:
    """SD3 sampler as a policy: `sample` draws SDE/ODE trajectories of latents `[N, C, h, w]` (the trajectory keeps
    ``latents`` `[N, S + 1, C, h, w]` and the text embeddings), `log_prob` replays their transitions, `likelihood`
    scores the final latents; outputs ``images`` `[N, 3, H, W]` in [0, 1]. Set-up, sampling, replay and checkpoints are
    shared with `flux` and `wan` ([`mmgrpo.pipelines._flow_policy`], at the end of the class)."""

    Config = SD3Config
    modalities = frozenset({"image"})
    plan_families = ("flow",)  # it reads FlowPlan only
    plan_features = PLAN_FEATURES  # merged steps, branches, per-sample units, DPM solver, likelihood
    provides = SCORE_FIELDS  # scoring method -> the Score fields it fills
    capabilities = frozenset({"chunked_rollouts"})  # no teacher_rollout: mmgrpo sft does not fine-tune it
    input_names = ("prompt_embeds", "pooled", "negative_prompt_embeds", "negative_pooled")  # kept for replay

    def __init__(self, config: SD3Config):
        from diffusers import StableDiffusion3Pipeline

        self.config = config
        self.flow = load_flow_pipeline(StableDiffusion3Pipeline, config)
        self.pipe = self.flow.pipe
        self.trainable = self.flow.experts[0]
        self.transformer = self.trainable.module  # the unwrapped module (checkpoints, adapters)
        self.device = torch.device("cpu")

    # ------------------------------------------------------------------------------------------------------ model
    def sigmas(self, num_steps: int) -> torch.Tensor:
        """The scheduler's sigmas for `num_steps` steps, `[num_steps + 1]`, ending at 0."""
        scheduler = self.pipe.scheduler
        kwargs = {}
        if scheduler.config.get("use_dynamic_shifting", False):
            from diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3 import calculate_shift

            side = self.config.resolution // self.pipe.vae_scale_factor // self.pipe.transformer.config.patch_size
            kwargs["mu"] = calculate_shift(
                side * side,
                scheduler.config.get("base_image_seq_len", 256),
                scheduler.config.get("max_image_seq_len", 4096),
                scheduler.config.get("base_shift", 0.5),
                scheduler.config.get("max_shift", 1.16),
            )
        scheduler.set_timesteps(num_steps, device="cpu", **kwargs)
        return scheduler.sigmas.float().clone()  # [S + 1]

    @property
    def do_cfg(self) -> bool:
        return self.config.guidance_scale > 1

    @torch.no_grad()
    def encode(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        """Text embeddings, `prompt_embeds` `[N, L, D]` and `pooled` `[N, P]` (plus negatives with CFG)."""
        pe, npe, pooled, npooled = self.pipe.encode_prompt(
            prompt=prompts,
            prompt_2=prompts,
            prompt_3=prompts,
            device=self.device,
            do_classifier_free_guidance=self.do_cfg,
            negative_prompt=[self.config.negative_prompt] * len(prompts) if self.do_cfg else None,
            max_sequence_length=self.config.max_sequence_length,
        )
        out = {"prompt_embeds": pe, "pooled": pooled}
        if self.do_cfg:
            out.update(negative_prompt_embeds=npe, negative_pooled=npooled)
        return out

    def velocity(self, latents, sigma, embeds, guidance: bool = True) -> torch.Tensor:
        """Velocity `[n, C, h, w]` for latents `[n, C, h, w]` at noise level `sigma`, guided (CFG) unless
        ``guidance=False`` (the conditional velocity, which the flow-matching likelihood scores)."""
        cfg = self.do_cfg and guidance
        dtype = self.pipe.transformer.dtype
        x = latents.to(dtype)
        text, pooled = embeds["prompt_embeds"], embeds["pooled"]
        if cfg:
            x = torch.cat([x, x])
            text = torch.cat([embeds["negative_prompt_embeds"], text])
            pooled = torch.cat([embeds["negative_pooled"], pooled])
        timestep = (sigma * self.pipe.scheduler.config.num_train_timesteps).to(self.device).expand(x.shape[0])
        v = self.trainable.forward(
            hidden_states=x, timestep=timestep, encoder_hidden_states=text.to(dtype), pooled_projections=pooled.to(dtype),
            return_dict=False,
        )[0].float()
        return guided(v, self.config.guidance_scale) if cfg else v

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Latents `[N, C, h, w]` -> images `[N, 3, H, W]` in [0, 1]."""
        return decode_images(self.pipe.vae, latents)

    def _noise(self, count: int, generator: torch.Generator | None) -> torch.Tensor:
        """Initial latents `[count, C, h, w]`, standard normal, drawn on the CPU as the diffusers pipeline does."""
        side = self.config.resolution // self.pipe.vae_scale_factor
        shape = (count, self.pipe.transformer.config.in_channels, side, side)
        return torch.randn(shape, generator=generator).to(self.device)

    # ------------------------------------------------------------------------- shared with every flow adapter
    # the protocol's members that do not depend on the model: pipelines/_flow_policy.py (`FlowModel`: what they read)
    num_steps, eval_num_steps, trainable_parameters, trainable_modules, prepare, reference = flow_policy.SETUP
    sample, log_prob, likelihood = flow_policy.SAMPLING
    save_pretrained, load_trainable, export_pretrained = flow_policy.CHECKPOINTS
    _inputs, _pick, _outputs = flow_policy.IMAGE_IO  # prompt embeddings in (a row per sample), images out


PLUGIN = SD3Policy
