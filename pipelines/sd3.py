"""Stable Diffusion 3 / 3.5 (MM-DiT, rectified flow) as a stochastic policy, with LoRA and optional CFG.

Wraps diffusers' `StableDiffusion3Pipeline` components (`SD3Transformer2DModel`, `AutoencoderKL`, CLIP and T5 text
encoders, `FlowMatchEulerDiscreteScheduler`); the adapter owns only the denoising loop, whose steps are taken by
[`mmgrpo.samplers.flow_sde.flow_sde_step`]. Paper: https://arxiv.org/abs/2403.03206
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch

from mmgrpo.hub import DTYPES, load_diffusers_pipeline
from mmgrpo.model_limits import RESOLUTION_LIMIT, check_limit, find_int, read_json
from mmgrpo.pipelines._checkpointing import checkpoint_diffusers
from mmgrpo.pipelines._flow_common import TrainableTransformer, check_flow_config
from mmgrpo.samplers.flow_plan import PLAN_FEATURES, SCORE_FIELDS, plan_likelihood, replay_plan, run_plan
from mmgrpo.types import PromptBatch, Rollout, Score
from mmgrpo.plans import FlowPlan


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
        if self.lora_rank < 0:
            raise ValueError(f"lora_rank must be >= 0 (0 = full fine-tuning), got {self.lora_rank}.")

    def output_size(self) -> tuple[int, str]:
        """Bytes of one sample's decoded image (float32 RGB), and the keys that set them: the memory check of
        [`~mmgrpo.preflight.preflight`] reads it."""
        return 3 * self.resolution**2 * 4, "pipeline.resolution"


class SD3Policy:
    """SD3 sampler as a policy: `sample` draws SDE/ODE trajectories, `log_prob` replays their transitions."""

    Config = SD3Config
    modalities = frozenset({"image"})
    plan_families = ("flow",)  # it reads FlowPlan only
    plan_features = PLAN_FEATURES  # merged steps, branches, per-sample units, DPM solver, likelihood
    provides = SCORE_FIELDS  # scoring method -> the Score fields it fills
    capabilities = frozenset()  # no optional members (no teacher_rollout: mmgrpo sft does not fine-tune it)

    def __init__(self, config: SD3Config):
        from diffusers import StableDiffusion3Pipeline

        self.config = config
        dtype = DTYPES[config.weights_dtype]
        self.pipe = load_diffusers_pipeline(StableDiffusion3Pipeline, config.pretrained, dtype=dtype)
        self.pipe.set_progress_bar_config(disable=True)
        for name in ("text_encoder", "text_encoder_2", "text_encoder_3", "vae", "transformer"):
            module = getattr(self.pipe, name, None)
            if module is not None:
                module.requires_grad_(False).eval()
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

    def velocity(self, latents, sigma, embeds, module=None, guidance: bool = True) -> torch.Tensor:
        """Velocity `[n, C, h, w]` for latents `[n, C, h, w]` at noise level `sigma`, guided (CFG) unless
        ``guidance=False`` (the conditional velocity, which the flow-matching likelihood scores)."""
        module = self.trainable.forward if module is None else module
        cfg = self.do_cfg and guidance
        dtype = self.pipe.transformer.dtype
        n = latents.shape[0]
        x = latents.to(dtype)
        text, pooled = embeds["prompt_embeds"], embeds["pooled"]
        if cfg:
            x = torch.cat([x, x])
            text = torch.cat([embeds["negative_prompt_embeds"], text])
            pooled = torch.cat([embeds["negative_pooled"], pooled])
        timestep = (sigma * self.pipe.scheduler.config.num_train_timesteps).to(self.device).expand(x.shape[0])
        v = module(
            hidden_states=x, timestep=timestep, encoder_hidden_states=text.to(dtype), pooled_projections=pooled.to(dtype),
            return_dict=False,
        )[0].float()
        if cfg:
            v_uncond, v_text = v[:n], v[n:]
            v = v_uncond + self.config.guidance_scale * (v_text - v_uncond)
        return v

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Latents `[N, C, h, w]` -> images `[N, 3, H, W]` in [0, 1]."""
        vae = self.pipe.vae
        z = latents.to(vae.dtype) / vae.config.scaling_factor + (vae.config.shift_factor or 0.0)
        images = vae.decode(z, return_dict=False)[0]
        return (images.float() / 2 + 0.5).clamp(0, 1)

    def _model(self, embeds: dict[str, torch.Tensor], guidance: bool = True):
        """``velocity(latents [r, ...], sigma, rows)`` over the samples `rows` (None: all) of `embeds`."""

        def velocity(x, sigma, rows=None):
            picked = embeds if rows is None else {k: v[rows.to(v.device)] for k, v in embeds.items()}
            return self.velocity(x, sigma, picked, guidance=guidance)

        return velocity

    def _noise(self, count: int, generator: torch.Generator | None) -> torch.Tensor:
        """Initial latents `[count, C, h, w]`, standard normal, drawn on the CPU as the diffusers pipeline does."""
        side = self.config.resolution // self.pipe.vae_scale_factor
        shape = (count, self.pipe.transformer.config.in_channels, side, side)
        return torch.randn(shape, generator=generator).to(self.device)

    def _embeds(self, trajectory: dict) -> dict[str, torch.Tensor]:
        names = ("prompt_embeds", "pooled", "negative_prompt_embeds", "negative_pooled")
        return {k: trajectory[k].to(self.device) for k in names if k in trajectory}

    @torch.no_grad()
    def sample(self, batch: PromptBatch, plan: FlowPlan, *, generator: torch.Generator | None = None) -> Rollout:
        """Samples one image per prompt following `plan` (SDE on `plan.sde_steps`, ODE elsewhere; merged steps,
        branches from a shared anchor, the DPM solver: see `mmgrpo.samplers.flow_plan`).

        The trajectory keeps every latent (`latents` `[N, S + 1, C, h, w]`), the text embeddings and the noise level
        of each step, so `log_prob` can re-score exactly the transitions taken.
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
            trajectory={**trajectory, **embeds},  # latents [N, S + 1, C, h, w], embeddings, shared_* step parameters
        )

    def log_prob(self, rollout: Rollout, steps: list[int]) -> Score:
        """Replays transitions `steps` under the current parameters (with gradients), for the samples that train
        them (`rollout.mask`).

        Returns:
            [`Score`] with `log_prob` `[n, k]`, `mean` `[n, k, C, h, w]`, ``std`` `[n, k, 1, 1, 1]` and ``mask``
            `[n, k]` (which entries are replayed transitions).
        """
        model = self._model(self._embeds(rollout.trajectory))
        return replay_plan(model, rollout.trajectory, rollout.group_ids, rollout.mask, steps, self.device)

    def likelihood(self, rollout: Rollout, steps: list[int]) -> Score:
        """Minus the flow-matching loss of the final latents at noise levels ``sigmas[j]``, `j` in `steps`, with noise
        shared within a group; the conditional velocity (no CFG), with gradients.

        Returns:
            [`Score`] with `log_prob` `[n, k]`, `velocity` `[n, k, C, h, w]` and ``group_ids`` `[n]`.
        """
        model = self._model(self._embeds(rollout.trajectory), guidance=False)
        return plan_likelihood(model, self._noise, rollout.trajectory, rollout.group_ids, steps, self.device)

    # ------------------------------------------------------------------------------------------------ checkpoints
    def save_pretrained(self, path: str) -> None:
        """Writes the trainable weights: a diffusers LoRA file (``pipe.load_lora_weights(path)`` reads it) or, when
        fully fine-tuned, a ``transformer/`` folder that replaces the base pipeline's."""
        from diffusers import StableDiffusion3Pipeline

        self.trainable.save(path, StableDiffusion3Pipeline)

    def load_trainable(self, path: str) -> None:
        """Loads weights written by [`~SD3Policy.save_pretrained`] into this policy."""
        self.trainable.load(path)

    def export_pretrained(self, path: str, merge_lora: bool = False) -> None:
        """Writes the whole diffusers pipeline with the trained weights (a LoRA fused in, or in ``lora/``), loadable
        with ``StableDiffusion3Pipeline.from_pretrained`` (see [`mmgrpo.export.export_diffusers`])."""
        from diffusers import StableDiffusion3Pipeline

        from mmgrpo.export import export_diffusers

        export_diffusers(self, StableDiffusion3Pipeline, self.config.pretrained, path, merge_lora, self.trainable.lora)


PLUGIN = SD3Policy
