"""FLUX.1 Kontext (instruction-based image editing on FLUX.1's rectified flow) as a stochastic policy, with LoRA.

Wraps diffusers' `FluxKontextPipeline` (the components of `FluxPipeline`). A prompt is an instruction with one input
image (``conditions["images"]`` of the prompt batch: the ``input_images`` capability). As the stock pipeline does it:
the input image is resized to the output resolution, encoded by the VAE's mode (``(z - shift) * scale``) and packed in
2x2 patches; its tokens `[N, L, 4C]` are concatenated after the noisy latents' in the transformer's input, with the
same position ids but the first id axis set to 1, and the velocity is the output's first `L` tokens. The image
latents are computed once per distinct image at sampling and kept in the trajectory, so replay and the
flow-matching likelihood see the same conditioning. Text encoding, noise levels (FLUX.1's dynamic shift of the output's
tokens), distilled guidance and decoding are the `flux` adapter's ([`mmgrpo.pipelines.flux.FluxPolicy`]).

Differences from the stock pipeline: the input image is resized to ``resolution x resolution`` (the stock pipeline
picks one of Kontext's preferred ~1 MP sizes by aspect ratio, ``_auto_resize``); true CFG with a negative prompt is not
offered (the released FLUX.1 Kontext [dev] uses only its distilled guidance).
Model: https://arxiv.org/abs/2506.15742 ; Flow-GRPO: https://arxiv.org/abs/2505.05470
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mmgrpo.pipelines._edit_images import CAPABILITY, batch_images, encode_once
from mmgrpo.pipelines._flow_policy import load_flow_pipeline
from mmgrpo.pipelines.flux import FluxConfig, FluxPolicy
from mmgrpo.types import PromptBatch


@dataclass
class FluxKontextConfig(FluxConfig):
    """Options of [`FluxKontextPolicy`]: those of [`~mmgrpo.pipelines.flux.FluxConfig`] (``pretrained``: a diffusers
    Kontext folder or hub id, e.g. ``black-forest-labs/FLUX.1-Kontext-dev``; ``guidance_scale``: Kontext's distilled
    guidance, 2.5 in its examples). The input image is resized to ``resolution x resolution``."""


class FluxKontextPolicy(FluxPolicy):
    """FLUX.1 Kontext editor as a policy: `sample` draws SDE/ODE trajectories of packed latents `[N, L, 4C]`
    conditioned on each prompt's input image (the trajectory keeps ``latents`` `[N, S + 1, L, 4C]`, the text
    embeddings and the packed ``image_latents`` `[N, L, 4C]`), `log_prob` replays their transitions, `likelihood`
    scores the final latents; outputs ``images`` `[N, 3, H, W]` in [0, 1]. Text encoding, noise levels and decoding
    are `FluxPolicy`'s; set-up, sampling, replay and checkpoints are shared ([`mmgrpo.pipelines._flow_policy`])."""

    Config = FluxKontextConfig
    capabilities = frozenset({CAPABILITY, "chunked_rollouts"})  # reads conditions["images"]: one input image per prompt
    input_names = ("prompt_embeds", "pooled", "image_latents")  # what the trajectory keeps for replay

    def __init__(self, config: FluxKontextConfig):
        from diffusers import FluxKontextPipeline

        self.config = config
        self.flow = load_flow_pipeline(FluxKontextPipeline, config)
        self.pipe = self.flow.pipe
        multiple = 2 * self.pipe.vae_scale_factor
        if config.resolution % multiple:
            raise ValueError(
                f"pipeline.resolution {config.resolution} is not a multiple of {multiple} (2x2 packing of the "
                f"{self.pipe.vae_scale_factor}x-downsampled latents of {config.pretrained}); "
                f"choose a multiple of {multiple}."
            )
        self.trainable = self.flow.experts[0]
        self.transformer = self.trainable.module
        self.device = torch.device("cpu")

    # ------------------------------------------------------------------------------------------------------ model
    @torch.no_grad()
    def _encode_image(self, images: list) -> torch.Tensor:
        """One prompt's input image -> packed latents `[1, L, 4C]`, as `FluxKontextPipeline` makes them (resize,
        preprocess to [-1, 1], the VAE's mode shifted and scaled, 2x2 packing)."""
        pipe, size = self.pipe, self.config.resolution
        pixels = pipe.image_processor.preprocess(pipe.image_processor.resize(images[0], size, size), size, size)
        z = pipe._encode_vae_image(pixels.to(self.device, pipe.vae.dtype), generator=None).float()  # [1, C, h, w]
        return pipe._pack_latents(z, 1, z.shape[1], z.shape[2], z.shape[3])  # [1, L, 4C]

    def _inputs(self, batch: PromptBatch) -> dict[str, torch.Tensor]:
        """Text embeddings (one row per sample) and ``image_latents`` `[N, L, 4C]`, each image encoded once."""
        rows = batch_images(batch, "flux_kontext", most=1)
        return {**self.encode(batch.prompts), "image_latents": encode_once(rows, self._encode_image)}

    def velocity(self, latents, sigma, embeds, guidance: bool = True) -> torch.Tensor:
        """Velocity `[n, L, 4C]` for packed latents `[n, L, 4C]` at noise level `sigma`: the transformer reads the
        latents' tokens followed by the image's (position ids with first axis 0, then 1) and its first `L` output
        tokens are the velocity; the distilled guidance whatever `guidance` says (as `FluxPolicy.velocity`)."""
        dtype = self.pipe.transformer.dtype
        n, length = latents.shape[:2]
        timestep = (sigma * self.pipe.scheduler.config.num_train_timesteps).to(self.device).expand(n) / 1000
        distilled = None
        if self.transformer.config.guidance_embeds:
            distilled = torch.full((n,), self.config.guidance_scale, device=self.device, dtype=torch.float32)
        text, image = embeds["prompt_embeds"], embeds["image_latents"]  # [n, L_text, D], [n, L, 4C]
        side = self.config.resolution // self.pipe.vae_scale_factor // 2
        ids = self.pipe._prepare_latent_image_ids(n, side, side, self.device, torch.float32)  # [L, 3]
        image_ids = ids.clone()
        image_ids[..., 0] = 1  # the pipeline marks the input image's tokens on the first axis
        out = self.trainable.forward(
            hidden_states=torch.cat([latents, image.to(latents.dtype)], dim=1).to(dtype), timestep=timestep,
            guidance=distilled, pooled_projections=embeds["pooled"].to(dtype), encoder_hidden_states=text.to(dtype),
            txt_ids=torch.zeros(text.shape[1], 3, device=self.device), img_ids=torch.cat([ids, image_ids]),
            return_dict=False,
        )[0]
        return out[:, :length].float()  # [n, L, 4C]

    def _noise(self, count: int, generator: torch.Generator | None) -> torch.Tensor:
        """Initial packed latents `[count, L, 4C]`, drawn as `FluxKontextPipeline` draws them (the image's encoding
        draws nothing)."""
        size, channels = self.config.resolution, self.pipe.transformer.config.in_channels // 4
        return self.pipe.prepare_latents(None, count, channels, size, size, torch.float32, self.device, generator)[0]


PLUGIN = FluxKontextPolicy
