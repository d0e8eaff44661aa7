"""FLUX.1 (guidance-distilled MM-DiT, rectified flow) as a stochastic policy, with LoRA.

Wraps diffusers' `FluxPipeline` components (`FluxTransformer2DModel` with its guidance embedding, `AutoencoderKL`,
`CLIPTextModel` + `T5EncoderModel`, `FlowMatchEulerDiscreteScheduler` with the resolution-dependent shift); latents
are packed in 2x2 patches as the pipeline does. Guidance is FLUX.1-dev's distilled guidance embedding: the scale is
an input of the transformer, one forward per step, no classifier-free batch doubling. The adapter supplies the
model, the initial noise, text encoding and decoding; the sampling and replay loops are shared with `sd3`
(`mmgrpo.samplers.flow_plan`), their steps taken by [`mmgrpo.samplers.flow_sde.flow_sde_step`].
Model: https://github.com/black-forest-labs/flux ; Flow-GRPO on FLUX: https://arxiv.org/abs/2505.05470
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import torch

from mmgrpo.pipelines._flow_common import (
    check_flow_config, check_packing, check_resolution, decode_images, image_bytes,
)
from mmgrpo.pipelines import _flow_policy as flow_policy
from mmgrpo.pipelines._flow_policy import load_flow_pipeline
from mmgrpo.samplers.flow_plan import PLAN_FEATURES, SCORE_FIELDS


@dataclass
class FluxConfig:
    """Options of [`FluxPolicy`]. Defaults follow Flow-GRPO's FLUX.1-dev recipe where it sets one.

    Args:
        pretrained (`str`): a diffusers FLUX folder or a hub id (e.g. ``black-forest-labs/FLUX.1-dev``).
        resolution (`int`): image height and width in pixels; a multiple of twice the VAE's downsampling (16 for
            FLUX.1).
        num_steps (`int`): denoising steps for training rollouts.
        eval_num_steps (`int`, *optional*): denoising steps for evaluation (default: `num_steps`).
        guidance_scale (`float`): the distilled guidance fed to the transformer's guidance embedding (FLUX.1-dev:
            3.5). Ignored by models without that embedding (FLUX.1-schnell).
        max_sequence_length (`int`): T5 tokens (at most 512).
        lora_rank (`int`): LoRA rank on the transformer; 0 trains the whole transformer.
        lora_alpha (`int`): LoRA scaling numerator.
        lora_targets (`list[str]`): transformer module names (suffixes) that get LoRA; the attention names also match
            the single-stream blocks' ``attn.to_q/k/v``.
        weights_dtype (`str`): dtype of the frozen components (text encoders, VAE, and the base transformer under
            LoRA). Trainable parameters are always float32.
        gradient_checkpointing (`bool`): recompute each transformer block in the backward pass (same gradients,
            activations of one block at a time, about one more forward of the transformer per backward).
    """

    pretrained: str
    resolution: int = 512
    num_steps: int = 6
    eval_num_steps: int | None = None
    guidance_scale: float = 3.5
    max_sequence_length: int = 512
    lora_rank: int = 64
    lora_alpha: int = 128
    lora_targets: list[str] = field(
        default_factory=lambda: [
            "attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0",
            "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out",
            "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2",
        ]
    )
    weights_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    gradient_checkpointing: bool = False

    def __post_init__(self):
        check_flow_config(self, max_tokens=512)  # FLUX's T5 limit
        check_resolution(self, "packing", fix="FLUX.1 is trained up to ~2048")
        if self.guidance_scale < 0:
            raise ValueError(f"guidance_scale must be >= 0 (FLUX.1-dev uses 3.5), got {self.guidance_scale}.")

    def output_size(self) -> tuple[int, str]:
        """Bytes of one sample's decoded image, and the key that sets them (for [`~mmgrpo.preflight.preflight`])."""
        return image_bytes(self.resolution), "pipeline.resolution"


class FluxPolicy:
    """FLUX sampler as a policy: `sample` draws SDE/ODE trajectories of packed latents `[N, L, 4C]` (the trajectory
    keeps ``latents`` `[N, S + 1, L, 4C]` and the text embeddings), `log_prob` replays their transitions, `likelihood`
    scores the final latents; outputs ``images`` `[N, 3, H, W]` in [0, 1]. Set-up, sampling, replay and checkpoints are
    shared with `sd3` and `wan` ([`mmgrpo.pipelines._flow_policy`], at the end of the class)."""

    Config = FluxConfig
    modalities = frozenset({"image"})
    plan_families = ("flow",)  # it reads FlowPlan only
    plan_features = PLAN_FEATURES  # merged steps, branches, per-sample units, DPM solver, likelihood
    provides = SCORE_FIELDS  # scoring method -> the Score fields it fills
    capabilities = frozenset({"chunked_rollouts"})  # no teacher_rollout: mmgrpo sft does not fine-tune it
    input_names = ("prompt_embeds", "pooled")  # what the trajectory keeps for replay

    def __init__(self, config: FluxConfig):
        from diffusers import FluxPipeline

        self.config = config
        self.flow = load_flow_pipeline(FluxPipeline, config)
        self.pipe = self.flow.pipe
        check_packing(self.pipe, config, "packing")
        self.trainable = self.flow.experts[0]
        self.transformer = self.trainable.module  # the unwrapped module (checkpoints, adapters)
        self.device = torch.device("cpu")

    # ------------------------------------------------------------------------------------------------------ model
    def sigmas(self, num_steps: int) -> torch.Tensor:
        """The sigmas `[num_steps + 1]` (ending at 0) that `FluxPipeline` uses at this resolution: ``linspace(1,
        1/S, S)`` shifted by the scheduler, with the dynamic shift ``mu`` computed from the packed image length."""
        from diffusers.pipelines.flux.pipeline_flux import calculate_shift, retrieve_timesteps

        scheduler = self.pipe.scheduler
        side = self.config.resolution // self.pipe.vae_scale_factor // 2
        mu = calculate_shift(
            side * side,  # packed image tokens
            scheduler.config.get("base_image_seq_len", 256),
            scheduler.config.get("max_image_seq_len", 4096),
            scheduler.config.get("base_shift", 0.5),
            scheduler.config.get("max_shift", 1.15),
        )
        sigmas = None if scheduler.config.get("use_flow_sigmas", False) else np.linspace(1.0, 1 / num_steps, num_steps)
        retrieve_timesteps(scheduler, num_steps, "cpu", sigmas=sigmas, mu=mu)
        return scheduler.sigmas.float().clone()  # [S + 1]

    @torch.no_grad()
    def encode(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        """Text embeddings: T5 `prompt_embeds` `[N, L, D]` and CLIP `pooled` `[N, P]`."""
        prompt_embeds, pooled, _ = self.pipe.encode_prompt(
            prompt=prompts, prompt_2=prompts, device=self.device, max_sequence_length=self.config.max_sequence_length
        )
        return {"prompt_embeds": prompt_embeds, "pooled": pooled}

    def velocity(self, latents, sigma, embeds, guidance: bool = True) -> torch.Tensor:
        """Velocity `[n, L, 4C]` for packed latents `[n, L, 4C]` at noise level `sigma`, with the distilled guidance
        whatever `guidance` says (there is no classifier-free guidance to switch off: the flow-matching likelihood
        scores this velocity too)."""
        dtype = self.pipe.transformer.dtype
        n = latents.shape[0]
        # FluxPipeline feeds the scheduler's timestep (sigma * num_train_timesteps) divided by 1000
        timestep = (sigma * self.pipe.scheduler.config.num_train_timesteps).to(self.device).expand(n) / 1000
        distilled = None
        if self.transformer.config.guidance_embeds:
            distilled = torch.full((n,), self.config.guidance_scale, device=self.device, dtype=torch.float32)
        text = embeds["prompt_embeds"]  # [n, L_text, D]
        side = self.config.resolution // self.pipe.vae_scale_factor // 2
        return self.trainable.forward(
            hidden_states=latents.to(dtype), timestep=timestep, guidance=distilled,
            pooled_projections=embeds["pooled"].to(dtype), encoder_hidden_states=text.to(dtype),
            txt_ids=torch.zeros(text.shape[1], 3, device=self.device),  # [L_text, 3], as encode_prompt makes them
            img_ids=self.pipe._prepare_latent_image_ids(n, side, side, self.device, torch.float32),  # [L, 3]
            return_dict=False,
        )[0].float()

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Packed latents `[N, L, 4C]` -> images `[N, 3, H, W]` in [0, 1]."""
        size = self.config.resolution
        z = self.pipe._unpack_latents(latents, size, size, self.pipe.vae_scale_factor)  # [N, C, h, w]
        return decode_images(self.pipe.vae, z)

    def _noise(self, count: int, generator: torch.Generator | None) -> torch.Tensor:
        """Initial packed latents `[count, L, 4C]`, drawn as `FluxPipeline` draws them (`[count, C, h, w]` standard
        normal from `generator`, on the CPU for a CPU generator, then packed in 2x2 patches)."""
        size, channels = self.config.resolution, self.pipe.transformer.config.in_channels // 4
        return self.pipe.prepare_latents(count, channels, size, size, torch.float32, self.device, generator)[0]

    # ------------------------------------------------------------------------- shared with every flow adapter
    # the protocol's members that do not depend on the model: pipelines/_flow_policy.py (`FlowModel`: what they read)
    num_steps, eval_num_steps, trainable_parameters, trainable_modules, prepare, reference = flow_policy.SETUP
    sample, log_prob, likelihood = flow_policy.SAMPLING
    save_pretrained, load_trainable, export_pretrained = flow_policy.CHECKPOINTS
    _inputs, _pick, _outputs = flow_policy.IMAGE_IO  # prompt embeddings in (a row per sample), images out


PLUGIN = FluxPolicy
