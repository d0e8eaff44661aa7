"""Qwen-Image (MMDiT with a Qwen2.5-VL text encoder, rectified flow) as a stochastic policy, with LoRA and true CFG.

Wraps diffusers' `QwenImagePipeline` components (`QwenImageTransformer2DModel`, `AutoencoderKLQwenImage`,
`Qwen2_5_VLForConditionalGeneration` as text encoder, `FlowMatchEulerDiscreteScheduler`). What is Qwen-Image's own,
as the stock pipeline does it: prompts are encoded through Qwen-Image's chat template by the last hidden states of
Qwen2.5-VL (the template's first tokens dropped), padded within a batch with their mask; latents are packed in 2x2
patches `[N, L, 4C]`; true CFG runs the negative prompt in a second forward and combines
``neg + s (cond - neg)``, then rescales each token's guided velocity to the conditional one's norm; the noise levels
are ``linspace(1, 1/S, S)`` shifted with the image-size dependent ``mu`` (and the scheduler's terminal shift); the
VAE is a causal 3D one read one frame at a time with per-channel mean / std. Sampling, replay and checkpoints are
shared with `sd3` and `flux` ([`mmgrpo.pipelines._flow_policy`]).
Model and report: https://github.com/QwenLM/Qwen-Image , https://arxiv.org/abs/2508.02324
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import torch

from mmgrpo.pipelines._flow_common import check_flow_config, check_packing, check_resolution, image_bytes
from mmgrpo.pipelines import _flow_policy as flow_policy
from mmgrpo.pipelines._flow_policy import load_flow_pipeline
from mmgrpo.samplers.flow_plan import PLAN_FEATURES, SCORE_FIELDS
from mmgrpo.validation import check_range


def rescaled_cfg(v: torch.Tensor, v_neg: torch.Tensor, scale: float) -> torch.Tensor:
    """Qwen-Image's true CFG ``neg + s (cond - neg)`` `[n, L, D]`, each token rescaled to the conditional one's norm."""
    combined = v_neg + scale * (v - v_neg)  # [n, L, D]
    return combined * (torch.norm(v, dim=-1, keepdim=True) / torch.norm(combined, dim=-1, keepdim=True))


@dataclass
class QwenImageConfig:
    """Options of [`QwenImagePolicy`]; names and meanings are `QwenImagePipeline.__call__`'s.

    Args:
        pretrained (`str`): a diffusers Qwen-Image folder or a hub id (``Qwen/Qwen-Image``, ``Qwen/Qwen-Image-2512``).
        resolution (`int`): image height and width in pixels; a multiple of twice the VAE's downsampling (16).
        num_steps (`int`): denoising steps for training rollouts.
        eval_num_steps (`int`, *optional*): denoising steps for evaluation (default: `num_steps`).
        true_cfg_scale (`float`): true classifier-free guidance with `negative_prompt`; 1 turns it off (one forward
            per step).
        negative_prompt (`str`): the negative prompt of true CFG (Qwen-Image's examples use ``" "``).
        guidance_scale (`float`): the distilled guidance fed to a transformer with a guidance embedding (ignored by
            the released Qwen-Image, which has none).
        max_sequence_length (`int`): text tokens kept after the template (at most 1024).
        lora_rank (`int`): LoRA rank on the transformer; 0 trains the whole transformer.
        lora_alpha (`int`): LoRA scaling numerator.
        lora_targets (`list[str]`): transformer module names (suffixes) that get LoRA.
        weights_dtype (`str`): dtype of the frozen components (text encoder, VAE, and the base transformer under
            LoRA). Trainable parameters are always float32.
        gradient_checkpointing (`bool`): recompute each transformer block in the backward pass.
    """

    pretrained: str
    resolution: int = 512
    num_steps: int = 10
    eval_num_steps: int | None = None
    true_cfg_scale: float = 4.0
    negative_prompt: str = " "
    guidance_scale: float = 1.0
    max_sequence_length: int = 512
    lora_rank: int = 64
    lora_alpha: int = 128
    lora_targets: list[str] = field(
        default_factory=lambda: [
            "attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0",
            "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out",
        ]
    )
    weights_dtype: Literal["float32", "bfloat16", "float16"] = "bfloat16"
    gradient_checkpointing: bool = False

    def __post_init__(self):
        check_flow_config(self, max_tokens=1024)  # QwenImagePipeline refuses more than 1024
        check_resolution(self, "packing", fix="Qwen-Image is trained up to ~1664")
        check_range("true_cfg_scale", self.true_cfg_scale, 1.0, 100.0, fix="1 turns true CFG off; Qwen-Image uses 4")

    def output_size(self) -> tuple[int, str]:
        """Bytes of one sample's decoded image, and the key that sets them (for [`~mmgrpo.preflight.preflight`])."""
        return image_bytes(self.resolution), "pipeline.resolution"


class QwenImagePolicy:
    """Qwen-Image sampler as a policy: `sample` draws SDE/ODE trajectories of packed latents `[N, L, 4C]` (the
    trajectory keeps ``latents`` `[N, S + 1, L, 4C]` and the text embeddings with their masks), `log_prob` replays
    their transitions, `likelihood` scores the final latents; outputs ``images`` `[N, 3, H, W]` in [0, 1]. Set-up,
    sampling, replay and checkpoints are shared with `sd3` and `flux` ([`mmgrpo.pipelines._flow_policy`])."""

    Config = QwenImageConfig
    modalities = frozenset({"image"})
    plan_families = ("flow",)
    plan_features = PLAN_FEATURES
    provides = SCORE_FIELDS
    capabilities = frozenset()
    input_names = ("prompt_embeds", "prompt_mask", "negative_prompt_embeds", "negative_prompt_mask")

    def __init__(self, config: QwenImageConfig):
        from diffusers import QwenImagePipeline

        self.config = config
        self.flow = load_flow_pipeline(QwenImagePipeline, config)
        self.pipe = self.flow.pipe
        check_packing(self.pipe, config, "packing")
        self.trainable = self.flow.experts[0]
        self.transformer = self.trainable.module
        self.device = torch.device("cpu")

    @property
    def _side(self) -> int:
        """Packed latent tokens per image side."""
        return self.config.resolution // self.pipe.vae_scale_factor // 2

    # ------------------------------------------------------------------------------------------------------ model
    def sigmas(self, num_steps: int) -> torch.Tensor:
        """The sigmas `[num_steps + 1]` (ending at 0) `QwenImagePipeline` uses at this resolution: ``linspace(1, 1/S,
        S)`` shifted by the scheduler with ``mu`` from the packed image length (and its terminal shift)."""
        from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift, retrieve_timesteps

        scheduler = self.pipe.scheduler
        mu = calculate_shift(
            self._side**2,
            scheduler.config.get("base_image_seq_len", 256),
            scheduler.config.get("max_image_seq_len", 4096),
            scheduler.config.get("base_shift", 0.5),
            scheduler.config.get("max_shift", 1.15),
        )
        retrieve_timesteps(scheduler, num_steps, "cpu", sigmas=np.linspace(1.0, 1 / num_steps, num_steps), mu=mu)
        return scheduler.sigmas.float().clone()  # [S + 1]

    @property
    def do_cfg(self) -> bool:
        return self.config.true_cfg_scale > 1

    @torch.no_grad()
    def _encode(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """Text states `[n, L, D]` padded within the batch and their mask `[n, L]` (the pipeline's ``encode_prompt``)."""
        embeds, mask = self.pipe.encode_prompt(
            prompt=list(prompts), device=self.device, max_sequence_length=self.config.max_sequence_length
        )
        if mask is None:  # the pipeline drops an all-ones mask
            mask = torch.ones(embeds.shape[:2], dtype=torch.long, device=embeds.device)
        return embeds, mask

    def encode(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        """``prompt_embeds`` `[N, L, D]` and ``prompt_mask`` `[N, L]` (and the negative prompt's with true CFG)."""
        embeds, mask = self._encode(prompts)
        out = {"prompt_embeds": embeds, "prompt_mask": mask}
        if self.do_cfg:
            negative, negative_mask = self._encode([self.config.negative_prompt])
            n = len(prompts)
            out.update(negative_prompt_embeds=negative.expand(n, -1, -1), negative_prompt_mask=negative_mask.expand(n, -1))
        return out

    def _forward(self, x: torch.Tensor, timestep: torch.Tensor, embeds: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """One transformer forward on packed latents `[n, L, 4C]`, text `[n, T, D]` with mask `[n, T]` -> `[n, L, 4C]`."""
        n, dtype = x.shape[0], self.pipe.transformer.dtype
        guidance = None
        if self.transformer.config.guidance_embeds:
            guidance = torch.full((n,), self.config.guidance_scale, device=self.device, dtype=torch.float32)
        return self.trainable.forward(
            hidden_states=x.to(dtype), timestep=timestep, guidance=guidance,
            encoder_hidden_states_mask=None if bool(mask.all()) else mask,  # the pipeline passes None for all-ones
            encoder_hidden_states=embeds.to(dtype), img_shapes=self._img_shapes(x), return_dict=False,
        )[0].float()

    def _img_shapes(self, x: torch.Tensor) -> list[list[tuple[int, int, int]]]:
        """The transformer's ``img_shapes`` for its input tokens `x` `[n, L, 4C]`: per sample, ``(frames, rows,
        columns)`` of each token grid (here the packed latents' alone)."""
        return [[(1, self._side, self._side)]] * x.shape[0]

    def velocity(self, latents, sigma, embeds, guidance: bool = True) -> torch.Tensor:
        """Velocity `[n, L, 4C]` for packed latents `[n, L, 4C]` at noise level `sigma`, with true CFG (a second
        forward on the negative prompt, each token rescaled to the conditional norm) unless ``guidance=False`` (the
        conditional velocity, which the flow-matching likelihood scores)."""
        n = latents.shape[0]
        timestep = (sigma * self.pipe.scheduler.config.num_train_timesteps).to(self.device).expand(n) / 1000
        v = self._forward(latents, timestep, embeds["prompt_embeds"], embeds["prompt_mask"])
        if not (self.do_cfg and guidance):
            return v
        v_neg = self._forward(latents, timestep, embeds["negative_prompt_embeds"], embeds["negative_prompt_mask"])
        return rescaled_cfg(v, v_neg, self.config.true_cfg_scale)

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Packed latents `[N, L, 4C]` -> images `[N, 3, H, W]` in [0, 1] (one frame of the 3D VAE)."""
        vae, size = self.pipe.vae, self.config.resolution
        z = self.pipe._unpack_latents(latents, size, size, self.pipe.vae_scale_factor).to(vae.dtype)  # [N, C, 1, h, w]
        mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1).to(z.device, z.dtype)
        inverse_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1).to(z.device, z.dtype)
        images = vae.decode(z / inverse_std + mean, return_dict=False)[0][:, :, 0]  # [N, 3, H, W], as the pipeline
        return (images.float() / 2 + 0.5).clamp(0, 1)

    def _noise(self, count: int, generator: torch.Generator | None) -> torch.Tensor:
        """Initial packed latents `[count, L, 4C]`, drawn as `QwenImagePipeline` draws them (`[count, 1, C, h, w]`
        standard normal from `generator`, then packed in 2x2 patches)."""
        size, channels = self.config.resolution, self.pipe.transformer.config.in_channels // 4
        return self.pipe.prepare_latents(count, channels, size, size, torch.float32, self.device, generator)

    # ------------------------------------------------------------------------- shared with every flow adapter
    num_steps, eval_num_steps, trainable_parameters, trainable_modules, prepare, reference = flow_policy.SETUP
    sample, log_prob, likelihood = flow_policy.SAMPLING
    save_pretrained, load_trainable, export_pretrained = flow_policy.CHECKPOINTS
    _inputs, _pick, _outputs = flow_policy.IMAGE_IO  # prompt embeddings in (a row per sample), images out


PLUGIN = QwenImagePolicy
