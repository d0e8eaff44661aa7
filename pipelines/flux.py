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

from mmgrpo.hub import DTYPES, load_diffusers_pipeline
from mmgrpo.model_limits import RESOLUTION_LIMIT
from mmgrpo.pipelines._checkpointing import checkpoint_diffusers
from mmgrpo.pipelines._flow_common import TrainableTransformer, check_flow_config
from mmgrpo.samplers.flow_plan import PLAN_FEATURES, SCORE_FIELDS, plan_likelihood, replay_plan, run_plan
from mmgrpo.types import PromptBatch, Rollout, Score
from mmgrpo.plans import FlowPlan
from mmgrpo.validation import check_range


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
        if self.resolution <= 0 or self.resolution % 16:
            raise ValueError(f"resolution must be a positive multiple of 16 (8x VAE, 2x2 packing): {self.resolution}.")
        check_range("resolution", self.resolution, 16, RESOLUTION_LIMIT, fix="FLUX.1 is trained up to ~2048")
        if self.guidance_scale < 0:
            raise ValueError(f"guidance_scale must be >= 0 (FLUX.1-dev uses 3.5), got {self.guidance_scale}.")
        if not 1 <= self.max_sequence_length <= 512:
            raise ValueError(f"max_sequence_length must be in [1, 512] (FLUX's T5 limit): {self.max_sequence_length}.")
        if self.lora_rank < 0:
            raise ValueError(f"lora_rank must be >= 0 (0 = full fine-tuning), got {self.lora_rank}.")

    def output_size(self) -> tuple[int, str]:
        """Bytes of one sample's decoded image (float32 RGB), and the keys that set them: the memory check of
        [`~mmgrpo.preflight.preflight`] reads it."""
        return 3 * self.resolution**2 * 4, "pipeline.resolution"


class FluxPolicy:
    """FLUX sampler as a policy: `sample` draws SDE/ODE trajectories, `log_prob` replays their transitions."""

    Config = FluxConfig
    modalities = frozenset({"image"})
    plan_families = ("flow",)  # it reads FlowPlan only
    plan_features = PLAN_FEATURES  # merged steps, branches, per-sample units, DPM solver, likelihood
    provides = SCORE_FIELDS  # scoring method -> the Score fields it fills
    capabilities = frozenset()  # no optional members (no teacher_rollout: mmgrpo sft does not fine-tune it)

    def __init__(self, config: FluxConfig):
        from diffusers import FluxPipeline

        self.config = config
        self.pipe = load_diffusers_pipeline(FluxPipeline, config.pretrained, dtype=DTYPES[config.weights_dtype])
        self.pipe.set_progress_bar_config(disable=True)
        multiple = 2 * self.pipe.vae_scale_factor
        if config.resolution % multiple:
            raise ValueError(
                f"pipeline.resolution {config.resolution} is not a multiple of {multiple} (2x2 packing of the "
                f"{self.pipe.vae_scale_factor}x-downsampled latents of {config.pretrained}); "
                f"choose a multiple of {multiple}."
            )
        for name in ("text_encoder", "text_encoder_2", "vae", "transformer"):
            getattr(self.pipe, name).requires_grad_(False).eval()
        self.trainable = TrainableTransformer(
            self.pipe.transformer, lora_rank=config.lora_rank, lora_alpha=config.lora_alpha,
            lora_targets=config.lora_targets, base_model=config.pretrained,
        )
        self.transformer = self.trainable.module  # the unwrapped module (checkpoints, adapters)
        if config.gradient_checkpointing:
            checkpoint_diffusers(self.transformer)
        self.device = torch.device("cpu")

    # ----------------------------------------------------------------------------------------------------- set-up
    def trainable_parameters(self):
        return self.trainable.parameters()

    def trainable_modules(self) -> dict[str, torch.nn.Module]:
        return {"transformer": self.transformer}

    @property
    def num_steps(self) -> int:
        return self.config.num_steps

    @property
    def eval_num_steps(self) -> int:
        return self.config.eval_num_steps or self.config.num_steps

    def prepare(self, accelerator) -> list[torch.nn.Module]:
        """Moves every component to the accelerator's device and wraps the trainable module for distribution."""
        self.device = accelerator.device
        self.pipe.to(self.device)
        return self.trainable.prepare(accelerator)

    def reference(self):
        """The reference policy: LoRA adapter disabled, or the frozen initial transformer when fully fine-tuned."""
        return self.trainable.reference()

    # --------------------------------------------------------------------------------------------------- sampling
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

    def velocity(self, latents, sigma, embeds, module=None) -> torch.Tensor:
        """Velocity `[n, L, 4C]` for packed latents `[n, L, 4C]` at noise level `sigma`, with the distilled guidance
        (there is no classifier-free guidance to switch off: the flow-matching likelihood scores this velocity too)."""
        module = self.trainable.forward if module is None else module
        dtype = self.pipe.transformer.dtype
        n = latents.shape[0]
        # FluxPipeline feeds the scheduler's timestep (sigma * num_train_timesteps) divided by 1000
        timestep = (sigma * self.pipe.scheduler.config.num_train_timesteps).to(self.device).expand(n) / 1000
        guidance = None
        if self.transformer.config.guidance_embeds:
            guidance = torch.full((n,), self.config.guidance_scale, device=self.device, dtype=torch.float32)
        text = embeds["prompt_embeds"]  # [n, L_text, D]
        side = self.config.resolution // self.pipe.vae_scale_factor // 2
        return module(
            hidden_states=latents.to(dtype), timestep=timestep, guidance=guidance,
            pooled_projections=embeds["pooled"].to(dtype), encoder_hidden_states=text.to(dtype),
            txt_ids=torch.zeros(text.shape[1], 3, device=self.device),  # [L_text, 3], as encode_prompt makes them
            img_ids=self.pipe._prepare_latent_image_ids(n, side, side, self.device, torch.float32),  # [L, 3]
            return_dict=False,
        )[0].float()

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Packed latents `[N, L, 4C]` -> images `[N, 3, H, W]` in [0, 1]."""
        vae = self.pipe.vae
        size = self.config.resolution
        z = self.pipe._unpack_latents(latents, size, size, self.pipe.vae_scale_factor)
        z = z.to(vae.dtype) / vae.config.scaling_factor + (vae.config.shift_factor or 0.0)  # [N, C, h, w]
        images = vae.decode(z, return_dict=False)[0]
        return (images.float() / 2 + 0.5).clamp(0, 1)

    def _model(self, embeds: dict[str, torch.Tensor]):
        """``velocity(latents [r, ...], sigma, rows)`` over the samples `rows` (None: all) of `embeds`."""

        def velocity(x, sigma, rows=None):
            picked = embeds if rows is None else {k: v[rows.to(v.device)] for k, v in embeds.items()}
            return self.velocity(x, sigma, picked)

        return velocity

    def _noise(self, count: int, generator: torch.Generator | None) -> torch.Tensor:
        """Initial packed latents `[count, L, 4C]`, drawn as `FluxPipeline` draws them (`[count, C, h, w]` standard
        normal from `generator`, on the CPU for a CPU generator, then packed in 2x2 patches)."""
        size, channels = self.config.resolution, self.pipe.transformer.config.in_channels // 4
        return self.pipe.prepare_latents(count, channels, size, size, torch.float32, self.device, generator)[0]

    def _embeds(self, trajectory: dict) -> dict[str, torch.Tensor]:
        return {k: trajectory[k].to(self.device) for k in ("prompt_embeds", "pooled")}

    @torch.no_grad()
    def sample(self, batch: PromptBatch, plan: FlowPlan, *, generator: torch.Generator | None = None) -> Rollout:
        """Samples one image per prompt following `plan` (SDE on `plan.sde_steps`, ODE elsewhere; merged steps,
        branches from a shared anchor, the DPM solver: see `mmgrpo.samplers.flow_plan`).

        The trajectory keeps every packed latent (`latents` `[N, S + 1, L, 4C]`), the text embeddings and the noise
        level of each step, so `log_prob` can re-score exactly the transitions taken.
        """
        n = len(batch)
        embeds = self.encode(batch.prompts)
        group_ids = batch.group_ids if batch.group_ids is not None else torch.arange(n)
        trajectory, log_probs, mask, group_ids = run_plan(
            self._model(embeds), self._noise, self.sigmas(plan.num_steps), plan, group_ids, batch.member_ids, generator
        )
        return Rollout(
            group_ids=group_ids,
            outputs={"images": self.decode(trajectory["latents"][:, -1]).cpu()},
            old_log_probs=log_probs,  # [N, S]
            mask=mask,
            trajectory={**trajectory, **embeds},  # latents [N, S + 1, L, 4C], embeddings, step parameters
        )

    def log_prob(self, rollout: Rollout, steps: list[int]) -> Score:
        """Replays transitions `steps` under the current parameters (with gradients), for the samples that train
        them (`rollout.mask`).

        Returns:
            [`Score`] with `log_prob` `[n, k]`, `mean` `[n, k, L, 4C]`, ``std`` `[n, k, 1, 1]` and ``mask`` `[n, k]`
            (which entries are replayed transitions).
        """
        model = self._model(self._embeds(rollout.trajectory))
        return replay_plan(model, rollout.trajectory, rollout.group_ids, rollout.mask, steps, self.device)

    def likelihood(self, rollout: Rollout, steps: list[int]) -> Score:
        """Minus the flow-matching loss of the final latents at noise levels ``sigmas[j]``, `j` in `steps`, with noise
        shared within a group, with gradients.

        Returns:
            [`Score`] with `log_prob` `[n, k]`, `velocity` `[n, k, L, 4C]` and ``group_ids`` `[n]`.
        """
        model = self._model(self._embeds(rollout.trajectory))
        return plan_likelihood(model, self._noise, rollout.trajectory, rollout.group_ids, steps, self.device)

    # ------------------------------------------------------------------------------------------------ checkpoints
    def save_pretrained(self, path: str) -> None:
        """Writes the trainable weights: a diffusers LoRA file with its adapter metadata
        (``FluxPipeline.load_lora_weights(path)`` reads it) or, when fully fine-tuned, a ``transformer/`` folder that
        replaces the base pipeline's."""
        from diffusers import FluxPipeline

        self.trainable.save(path, FluxPipeline)

    def load_trainable(self, path: str) -> None:
        """Loads weights written by [`~FluxPolicy.save_pretrained`] into this policy."""
        self.trainable.load(path)

    def export_pretrained(self, path: str, merge_lora: bool = False) -> None:
        """Writes the whole diffusers pipeline with the trained weights (a LoRA fused in, or in ``lora/``), loadable
        with ``FluxPipeline.from_pretrained`` (see [`mmgrpo.export.export_diffusers`])."""
        from diffusers import FluxPipeline

        from mmgrpo.export import export_diffusers

        export_diffusers(self, FluxPipeline, self.config.pretrained, path, merge_lora, self.trainable.lora)


PLUGIN = FluxPolicy
