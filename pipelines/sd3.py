"""Stable Diffusion 3 / 3.5 (MM-DiT, rectified flow) as a stochastic policy, with LoRA and optional CFG.

Wraps diffusers' `StableDiffusion3Pipeline` components (`SD3Transformer2DModel`, `AutoencoderKL`, CLIP and T5 text
encoders, `FlowMatchEulerDiscreteScheduler`); the adapter owns only the denoising loop, whose steps are taken by
[`mmgrpo.samplers.flow_sde.flow_sde_step`]. Paper: https://arxiv.org/abs/2403.03206
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch

from mmgrpo.hub import load_diffusers_pipeline, resolve_pretrained
from mmgrpo.samplers.flow_sde import flow_sde_step
from mmgrpo.types import PromptBatch, Rollout, SamplingPlan

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
LORA_WEIGHTS = "pytorch_lora_weights.safetensors"


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

    def __post_init__(self):
        self.pretrained = resolve_pretrained(self.pretrained, "pipeline.pretrained")
        if self.resolution <= 0 or self.resolution % 8:
            raise ValueError(f"resolution must be a positive multiple of 8, got {self.resolution}.")
        if self.num_steps < 1:
            raise ValueError(f"num_steps must be >= 1, got {self.num_steps}.")
        if self.guidance_scale < 1:
            raise ValueError(f"guidance_scale must be >= 1 (1 disables CFG), got {self.guidance_scale}.")
        if self.lora_rank < 0:
            raise ValueError(f"lora_rank must be >= 0 (0 = full fine-tuning), got {self.lora_rank}.")


class SD3Policy:
    """SD3 sampler as a policy: `sample` draws SDE/ODE trajectories, `log_prob` replays their transitions."""

    Config = SD3Config
    modalities = frozenset({"image"})

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
        transformer = self.pipe.transformer
        self._reference_transformer = None
        if config.lora_rank > 0:
            from peft import LoraConfig

            transformer.add_adapter(
                LoraConfig(
                    r=config.lora_rank,
                    lora_alpha=config.lora_alpha,
                    init_lora_weights="gaussian",
                    target_modules=config.lora_targets,
                )
            )
            for param in transformer.parameters():
                if param.requires_grad:
                    param.data = param.data.float()
        else:
            transformer.float().requires_grad_(True)
            self._reference_transformer = copy.deepcopy(transformer).requires_grad_(False).eval()
        self.transformer = transformer  # the unwrapped module (checkpoints, adapters)
        self._forward = transformer  # what forwards run through (a DDP/FSDP wrapper after `prepare`)
        self.device = torch.device("cpu")

    # ----------------------------------------------------------------------------------------------------- set-up
    def trainable_parameters(self):
        return [p for p in self.transformer.parameters() if p.requires_grad]

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
        if self._reference_transformer is not None:
            self._reference_transformer.to(self.device)
        self._forward = accelerator.prepare_model(self.transformer)
        return [self._forward]

    @contextlib.contextmanager
    def reference(self):
        """The reference policy: LoRA adapter disabled, or the frozen initial transformer when fully fine-tuned."""
        if self._reference_transformer is not None:
            previous, self._forward = self._forward, self._reference_transformer
            try:
                yield
            finally:
                self._forward = previous
        else:
            self.transformer.disable_adapters()
            try:
                yield
            finally:
                self.transformer.enable_adapters()

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

    def velocity(self, latents, sigma, embeds, module=None) -> torch.Tensor:
        """Guided velocity `[n, C, h, w]` for latents `[n, C, h, w]` at noise level `sigma`."""
        module = self._forward if module is None else module
        dtype = self.pipe.transformer.dtype
        n = latents.shape[0]
        x = latents.to(dtype)
        text, pooled = embeds["prompt_embeds"], embeds["pooled"]
        if self.do_cfg:
            x = torch.cat([x, x])
            text = torch.cat([embeds["negative_prompt_embeds"], text])
            pooled = torch.cat([embeds["negative_pooled"], pooled])
        timestep = (sigma * self.pipe.scheduler.config.num_train_timesteps).to(self.device).expand(x.shape[0])
        v = module(
            hidden_states=x, timestep=timestep, encoder_hidden_states=text.to(dtype), pooled_projections=pooled.to(dtype),
            return_dict=False,
        )[0].float()
        if self.do_cfg:
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

    @torch.no_grad()
    def sample(self, batch: PromptBatch, plan: SamplingPlan, *, generator: torch.Generator | None = None) -> Rollout:
        """Samples one image per prompt following `plan` (SDE on `plan.sde_steps`, ODE elsewhere).

        The trajectory keeps every latent (`latents` `[N, S + 1, C, h, w]`), the text embeddings and the noise level
        of each step, so `log_prob` can re-score exactly the transitions taken.
        """
        n = len(batch)
        embeds = self.encode(batch.prompts)
        sigmas = self.sigmas(plan.num_steps)
        noise_levels = torch.tensor([plan.noise_level if i in plan.sde_steps else 0.0 for i in range(plan.num_steps)])
        channels = self.pipe.transformer.config.in_channels
        side = self.config.resolution // self.pipe.vae_scale_factor
        shape = (n, channels, side, side)
        latents = torch.randn(shape, generator=generator).to(self.device)
        states, log_probs = [latents], []
        for i in range(plan.num_steps):
            v = self.velocity(latents, sigmas[i], embeds)
            noise = torch.randn(shape, generator=generator).to(self.device) if noise_levels[i] > 0 else None
            step = flow_sde_step(
                v, latents, sigmas[i], sigmas[i + 1], noise_level=float(noise_levels[i]), sde_type=plan.sde_type,
                sigma_at_one=sigmas[1], noise=noise,
            )
            latents = step.prev_sample
            states.append(latents)
            log_probs.append(step.log_prob)
        mask = torch.zeros(n, plan.num_steps, dtype=torch.bool)
        mask[:, [s for unit in plan.train_units for s in unit]] = True
        return Rollout(
            group_ids=batch.group_ids if batch.group_ids is not None else torch.arange(n),
            outputs={"images": self.decode(latents).cpu()},
            old_log_probs=torch.stack(log_probs, dim=1).cpu(),  # [N, S]
            mask=mask,
            trajectory={
                "latents": torch.stack(states, dim=1),  # [N, S + 1, C, h, w]
                **embeds,
                "shared_sigmas": sigmas,  # [S + 1]
                "shared_noise_levels": noise_levels,  # [S]
                "shared_sde_type": plan.sde_type,
            },
        )

    def log_prob(self, rollout: Rollout, steps: list[int]) -> dict[str, torch.Tensor]:
        """Replays transitions `steps` under the current parameters (with gradients).

        Returns:
            `dict` with ``log_prob`` `[n, k]`, ``mean`` `[n, k, C, h, w]` and ``std`` `[n, k, 1, 1, 1]`.
        """
        traj = rollout.trajectory
        sigmas, levels = traj["shared_sigmas"], traj["shared_noise_levels"]
        latents = traj["latents"].to(self.device)
        embeds = {k: traj[k].to(self.device) for k in ("prompt_embeds", "pooled", "negative_prompt_embeds", "negative_pooled") if k in traj}
        outs = []
        for i in steps:
            v = self.velocity(latents[:, i], sigmas[i], embeds)
            outs.append(
                flow_sde_step(
                    v, latents[:, i], sigmas[i], sigmas[i + 1], noise_level=float(levels[i]),
                    sde_type=traj["shared_sde_type"], sigma_at_one=sigmas[1], prev_sample=latents[:, i + 1],
                )
            )
        return {
            "log_prob": torch.stack([o.log_prob for o in outs], dim=1),
            "mean": torch.stack([o.mean for o in outs], dim=1),
            "std": torch.stack([o.std for o in outs], dim=1),
        }

    # ------------------------------------------------------------------------------------------------ checkpoints
    def save_pretrained(self, path: str) -> None:
        """Writes the trainable weights: a diffusers LoRA file (``pipe.load_lora_weights(path)`` reads it) or, when
        fully fine-tuned, a ``transformer/`` folder that replaces the base pipeline's."""
        from diffusers import StableDiffusion3Pipeline

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        if self.config.lora_rank > 0:
            from peft.utils import get_peft_model_state_dict

            StableDiffusion3Pipeline.save_lora_weights(
                path,
                transformer_lora_layers=get_peft_model_state_dict(self.transformer),
                transformer_lora_adapter_metadata=self.transformer.peft_config["default"].to_dict(),
                safe_serialization=True,
            )
        else:
            self.transformer.save_pretrained(path / "transformer")

    def load_trainable(self, path: str) -> None:
        """Loads weights written by [`~SD3Policy.save_pretrained`] into this policy."""
        path = Path(path)
        if self.config.lora_rank > 0:
            from peft.utils import set_peft_model_state_dict
            from safetensors.torch import load_file

            state = load_file(path / LORA_WEIGHTS)
            state = {k.removeprefix("transformer."): v for k, v in state.items()}
            result = set_peft_model_state_dict(self.transformer, state)
            if getattr(result, "unexpected_keys", None):
                raise ValueError(f"LoRA file {path / LORA_WEIGHTS} has keys this model lacks: {result.unexpected_keys[:3]}")
        else:
            from diffusers import SD3Transformer2DModel

            loaded = SD3Transformer2DModel.from_pretrained(path / "transformer")
            self.transformer.load_state_dict(loaded.state_dict())


PLUGIN = SD3Policy
