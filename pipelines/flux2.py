"""FLUX.2 [dev] and FLUX.2 [klein] (MM-DiT with single-stream blocks, rectified flow) as a stochastic policy, with
LoRA.

Wraps diffusers' `Flux2Pipeline` (Mistral-3 text encoder, distilled guidance embedding) or `Flux2KleinPipeline`
(Qwen3 text encoder; true CFG against the empty prompt on the base models, none on the step-distilled ones marked
``is_distilled``), both with `Flux2Transformer2DModel`, `AutoencoderKLFlux2` and `FlowMatchEulerDiscreteScheduler`.
What is FLUX.2's own, as the stock pipelines do it: the text embedding stacks several hidden states of the text
encoder (``text_encoder_out_layers``) with 4-axis position ids; latents are patchified 2x2 and flattened to tokens
`[N, L, 4C]` with 4-axis position ids; the noise levels are ``linspace(1, 1/S, S)`` shifted with FLUX.2's empirical
``mu``, which depends on the image's token count and on the number of steps (so few-step schedules are the stock
ones); decoding undoes the VAE's latent batch norm. Sampling, replay and checkpoints are shared with `sd3` and `flux`
([`mmgrpo.pipelines._flow_policy`]). Model: https://github.com/black-forest-labs/flux2
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import torch

from mmgrpo.hub import resolve_pretrained
from mmgrpo.model_limits import read_json
from mmgrpo.pipelines._flow_common import check_flow_config, check_packing, check_resolution, image_bytes
from mmgrpo.pipelines import _flow_policy as flow_policy
from mmgrpo.pipelines._flow_policy import load_flow_pipeline
from mmgrpo.samplers.flow_plan import PLAN_FEATURES, SCORE_FIELDS
from mmgrpo.validation import check_range

PIPELINES = ("Flux2Pipeline", "Flux2KleinPipeline")


@dataclass
class Flux2Config:
    """Options of [`Flux2Policy`]; names and meanings are the stock pipelines' ``__call__``'s.

    Args:
        pretrained (`str`): a diffusers FLUX.2 folder or a hub id (``black-forest-labs/FLUX.2-klein-base-4B``,
            ``black-forest-labs/FLUX.2-klein-4B``, ``black-forest-labs/FLUX.2-dev``).
        pipeline_class (`str`): ``Flux2Pipeline`` or ``Flux2KleinPipeline``; ``auto`` reads the model's
            ``model_index.json`` (a local folder or the local hub cache).
        resolution (`int`): image height and width in pixels; a multiple of twice the VAE's downsampling (16).
        num_steps (`int`): denoising steps for training rollouts.
        eval_num_steps (`int`, *optional*): denoising steps for evaluation (default: `num_steps`).
        guidance_scale (`float`): FLUX.2 [dev]: the distilled guidance fed to the transformer; FLUX.2 [klein] base:
            true CFG against the empty prompt, off at 1 or below; ignored by the step-distilled [klein] models.
        max_sequence_length (`int`): text tokens (chat template included, at most 512 as the stock pipelines).
        text_encoder_out_layers (`list[int]`, *optional*): hidden states of the text encoder stacked into the text
            embedding (default: the pipeline's, (10, 20, 30) for [dev], (9, 18, 27) for [klein]).
        lora_rank (`int`): LoRA rank on the transformer; 0 trains the whole transformer.
        lora_alpha (`int`): LoRA scaling numerator.
        lora_targets (`list[str]`): transformer module names (suffixes) that get LoRA (the single-stream blocks'
            fused ``to_qkv_mlp_proj`` included).
        weights_dtype (`str`): dtype of the frozen components (text encoder, VAE, and the base transformer under
            LoRA). Trainable parameters are always float32.
        gradient_checkpointing (`bool`): recompute each transformer block in the backward pass.
    """

    pretrained: str
    pipeline_class: Literal["auto", "Flux2Pipeline", "Flux2KleinPipeline"] = "auto"
    resolution: int = 512
    num_steps: int = 8
    eval_num_steps: int | None = None
    guidance_scale: float = 4.0
    max_sequence_length: int = 512
    text_encoder_out_layers: list[int] | None = None
    lora_rank: int = 64
    lora_alpha: int = 128
    lora_targets: list[str] = field(
        default_factory=lambda: [
            "attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0",
            "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out", "attn.to_qkv_mlp_proj",
        ]
    )
    weights_dtype: Literal["float32", "bfloat16", "float16"] = "bfloat16"
    gradient_checkpointing: bool = False

    def __post_init__(self):
        location, _ = check_flow_config(self, max_tokens=512)  # the stock pipelines' tokenizer_max_length
        check_resolution(self, "patches", fix="FLUX.2 is trained up to ~2048")
        check_range("guidance_scale", self.guidance_scale, 0.0, fix="FLUX.2 uses 4 ([dev] distilled, [klein] CFG)")
        for layer in self.text_encoder_out_layers or []:
            check_range("text_encoder_out_layers", layer, -1000, 1000, fix="hidden-state indices of the text encoder")
        if self.text_encoder_out_layers is not None and not self.text_encoder_out_layers:
            raise ValueError("text_encoder_out_layers must name at least one layer (leave it out for the default).")
        if self.pipeline_class == "auto":
            found = read_json(location, "model_index.json").get("_class_name")
            if found not in PIPELINES:
                raise ValueError(
                    f"pipeline_class: auto cannot tell the FLUX.2 pipeline of {self.pretrained} (model_index.json "
                    f"names {found!r}); set pipeline_class to one of {list(PIPELINES)}."
                )

    def pipeline_name(self) -> str:
        """The diffusers pipeline class name (``auto`` resolved from the model's ``model_index.json``)."""
        if self.pipeline_class != "auto":
            return self.pipeline_class
        location = resolve_pretrained(self.pretrained, "pipeline.pretrained")
        return read_json(location, "model_index.json")["_class_name"]

    def output_size(self) -> tuple[int, str]:
        """Bytes of one sample's decoded image, and the key that sets them (for [`~mmgrpo.preflight.preflight`])."""
        return image_bytes(self.resolution), "pipeline.resolution"


class Flux2Policy:
    """FLUX.2 sampler as a policy: `sample` draws SDE/ODE trajectories of latent tokens `[N, L, 4C]` (the trajectory
    keeps ``latents`` `[N, S + 1, L, 4C]` and the text embeddings), `log_prob` replays their transitions, `likelihood`
    scores the final latents; outputs ``images`` `[N, 3, H, W]` in [0, 1]. Set-up, sampling, replay and checkpoints are
    shared with `sd3` and `flux` ([`mmgrpo.pipelines._flow_policy`], at the end of the class)."""

    Config = Flux2Config
    modalities = frozenset({"image"})
    plan_families = ("flow",)
    plan_features = PLAN_FEATURES
    provides = SCORE_FIELDS
    capabilities = frozenset({"chunked_rollouts"})
    input_names = ("prompt_embeds", "negative_prompt_embeds")

    def __init__(self, config: Flux2Config):
        from diffusers import Flux2KleinPipeline, Flux2Pipeline

        self.config = config
        name = config.pipeline_name()
        self.klein = name == "Flux2KleinPipeline"
        self.flow = load_flow_pipeline(Flux2KleinPipeline if self.klein else Flux2Pipeline, config)
        self.pipe = self.flow.pipe
        check_packing(self.pipe, config, "patches")
        self.trainable = self.flow.experts[0]
        self.transformer = self.trainable.module
        self.device = torch.device("cpu")

    @property
    def _side(self) -> int:
        """Latent tokens per image side (after the 2x2 patchify)."""
        return self.config.resolution // self.pipe.vae_scale_factor // 2

    # ------------------------------------------------------------------------------------------------------ model
    def sigmas(self, num_steps: int) -> torch.Tensor:
        """The sigmas `[num_steps + 1]` (ending at 0) the stock FLUX.2 pipelines use: ``linspace(1, 1/S, S)`` shifted
        by the scheduler with FLUX.2's empirical ``mu`` of the image's token count and the step count."""
        from diffusers.pipelines.flux2.pipeline_flux2 import compute_empirical_mu, retrieve_timesteps

        scheduler = self.pipe.scheduler
        sigmas = None if scheduler.config.get("use_flow_sigmas", False) else np.linspace(1.0, 1 / num_steps, num_steps)
        mu = compute_empirical_mu(image_seq_len=self._side**2, num_steps=num_steps)
        retrieve_timesteps(scheduler, num_steps, "cpu", sigmas=sigmas, mu=mu)
        return scheduler.sigmas.float().clone()  # [S + 1]

    @property
    def do_cfg(self) -> bool:
        """True CFG: FLUX.2 [klein] base models with ``guidance_scale > 1`` (not the step-distilled ones)."""
        return self.klein and self.config.guidance_scale > 1 and not self.pipe.config.is_distilled

    @torch.no_grad()
    def _encode(self, prompts: list[str]) -> torch.Tensor:
        layers = self.config.text_encoder_out_layers
        extra = {} if layers is None else {"text_encoder_out_layers": tuple(layers)}
        embeds, _ = self.pipe.encode_prompt(
            prompt=list(prompts), device=self.device, max_sequence_length=self.config.max_sequence_length, **extra
        )
        return embeds  # [n, T, D]

    def encode(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        """``prompt_embeds`` `[N, T, D]` (and the empty prompt's, ``negative_prompt_embeds``, with CFG)."""
        out = {"prompt_embeds": self._encode(prompts)}
        if self.do_cfg:
            out["negative_prompt_embeds"] = self._encode([""]).expand(len(prompts), -1, -1)
        return out

    def _forward(self, x: torch.Tensor, timestep: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
        """One transformer forward on latent tokens `[n, L, 4C]` and text `[n, T, D]` -> `[n, L, 4C]` in float32."""
        n, dtype = x.shape[0], self.pipe.transformer.dtype
        guidance = None
        if self.transformer.config.guidance_embeds:  # FLUX.2 [dev]'s distilled guidance
            guidance = torch.full([1], self.config.guidance_scale, device=self.device, dtype=torch.float32).expand(n)
        img_ids = self.pipe._prepare_latent_ids(x.new_empty(n, 1, self._side, self._side)).to(self.device)  # [n, L, 4]
        return self.trainable.forward(
            hidden_states=x.to(dtype), timestep=timestep, guidance=guidance, encoder_hidden_states=text.to(dtype),
            txt_ids=self.pipe._prepare_text_ids(text).to(self.device), img_ids=img_ids, return_dict=False,
        )[0][:, : x.shape[1]].float()

    def velocity(self, latents, sigma, embeds, guidance: bool = True) -> torch.Tensor:
        """Velocity `[n, L, 4C]` for latent tokens `[n, L, 4C]` at noise level `sigma`; with [klein]'s true CFG
        ``neg + s (cond - neg)`` (a second forward) unless ``guidance=False`` (the conditional velocity, which the
        flow-matching likelihood scores; [dev]'s distilled guidance is an input and stays)."""
        n = latents.shape[0]
        timestep = (sigma * self.pipe.scheduler.config.num_train_timesteps).to(self.device).expand(n) / 1000
        v = self._forward(latents, timestep, embeds["prompt_embeds"])
        if not (self.do_cfg and guidance):
            return v
        v_neg = self._forward(latents, timestep, embeds["negative_prompt_embeds"])
        return v_neg + self.config.guidance_scale * (v - v_neg)

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Latent tokens `[N, L, 4C]` -> images `[N, 3, H, W]` in [0, 1] (batch norm undone, 2x2 unpatchified)."""
        vae, n = self.pipe.vae, latents.shape[0]
        ids = self.pipe._prepare_latent_ids(latents.new_empty(n, 1, self._side, self._side)).to(latents.device)
        z = self.pipe._unpack_latents_with_ids(latents, ids)  # [N, 4C, h, w] (the sizes read from the ids)
        mean = vae.bn.running_mean.view(1, -1, 1, 1).to(z.device, z.dtype)
        std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps).to(z.device, z.dtype)
        z = self.pipe._unpatchify_latents(z * std + mean)  # [N, C, 2h, 2w]
        images = vae.decode(z.to(vae.dtype), return_dict=False)[0]
        return (images.float() / 2 + 0.5).clamp(0, 1)

    def _noise(self, count: int, generator: torch.Generator | None) -> torch.Tensor:
        """Initial latent tokens `[count, L, 4C]`, drawn as the stock pipelines draw them (`[count, 4C, h, w]` standard
        normal from `generator`, then flattened)."""
        size, channels = self.config.resolution, self.pipe.transformer.config.in_channels // 4
        return self.pipe.prepare_latents(count, channels, size, size, torch.float32, self.device, generator)[0]

    # ------------------------------------------------------------------------- shared with every flow adapter
    num_steps, eval_num_steps, trainable_parameters, trainable_modules, prepare, reference = flow_policy.SETUP
    sample, log_prob, likelihood = flow_policy.SAMPLING
    save_pretrained, load_trainable, export_pretrained = flow_policy.CHECKPOINTS
    _inputs, _pick, _outputs = flow_policy.IMAGE_IO  # prompt embeddings in (a row per sample), images out


PLUGIN = Flux2Policy
