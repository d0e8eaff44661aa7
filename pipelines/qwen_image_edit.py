"""Qwen-Image-Edit (instruction-based image editing on Qwen-Image's MMDiT) as a stochastic policy, with LoRA and true
CFG.

Wraps diffusers' `QwenImageEditPipeline` (Qwen-Image's components plus the Qwen2.5-VL ``processor``). A prompt is an
instruction with one input image (``conditions["images"]`` of the prompt batch: the ``input_images`` capability). As
the stock pipeline does it: the input image is resized to the condition size (about `condition_area` pixels, sides
multiples of 32); Qwen2.5-VL reads it with the instruction through the edit template (and with the negative prompt
for true CFG), so the text states depend on the image; the VAE encodes it (its mode, per-channel mean / std) and its
packed tokens follow the noisy latents' in the transformer's input, ``img_shapes`` naming both grids; the velocity is
the output's first `L` tokens. Text states and image latents are computed once per distinct (instruction, image) at
sampling and kept in the trajectory. Noise levels, true CFG with its norm rescale, and decoding are the `qwen_image`
adapter's ([`mmgrpo.pipelines.qwen_image.QwenImagePolicy`]).

Difference from the stock pipeline: the condition size is the square of about `condition_area` pixels (the stock
pipeline keeps the input image's aspect ratio), so the images of a batch share one token grid.
Model and report: https://github.com/QwenLM/Qwen-Image , https://arxiv.org/abs/2508.02324
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mmgrpo.pipelines._edit_images import CAPABILITY, batch_images, image_key, to_pil, to_pixels
from mmgrpo.pipelines._flow_policy import load_flow_pipeline
from mmgrpo.pipelines.qwen_image import QwenImageConfig, QwenImagePolicy, rescaled_cfg
from mmgrpo.types import PromptBatch
from mmgrpo.validation import check_range


@dataclass
class QwenImageEditConfig(QwenImageConfig):
    """Options of [`QwenImageEditPolicy`]: those of [`~mmgrpo.pipelines.qwen_image.QwenImageConfig`] (``pretrained``:
    a diffusers Qwen-Image-Edit folder or hub id, e.g. ``Qwen/Qwen-Image-Edit``), and:

    Args:
        condition_area (`int`, defaults to 1048576): pixels of the resized input image (the stock pipeline's
            1024 x 1024); its side is ``round(sqrt(area) / 32) * 32``.
    """

    condition_area: int = 1024 * 1024

    def __post_init__(self):
        super().__post_init__()
        check_range("condition_area", self.condition_area, 32 * 32, 4096 * 4096, fix="the stock pipeline uses 1048576")


class QwenImageEditPolicy(QwenImagePolicy):
    """Qwen-Image-Edit as a policy: `sample` draws SDE/ODE trajectories of packed latents `[N, L, 4C]` conditioned on
    each prompt's input image (the trajectory keeps ``latents``, the image-aware text states with their masks and the
    packed ``image_latents`` `[N, L', 4C]`), `log_prob` replays their transitions, `likelihood` scores the final
    latents; outputs ``images`` `[N, 3, H, W]` in [0, 1]."""

    Config = QwenImageEditConfig
    capabilities = frozenset({CAPABILITY})  # reads conditions["images"]: one input image per prompt
    input_names = QwenImagePolicy.input_names + ("image_latents",)

    def __init__(self, config: QwenImageEditConfig):
        from diffusers import QwenImageEditPipeline

        self.config = config
        self.flow = load_flow_pipeline(QwenImageEditPipeline, config)
        self.pipe = self.flow.pipe
        multiple = 2 * self.pipe.vae_scale_factor
        if config.resolution % multiple:
            raise ValueError(f"pipeline.resolution {config.resolution} is not a multiple of {multiple} (2x2 packing of "
                             f"the {self.pipe.vae_scale_factor}x-downsampled latents); choose a multiple of {multiple}.")
        self.trainable = self.flow.experts[0]
        self.transformer = self.trainable.module
        self.device = torch.device("cpu")

    @property
    def condition_size(self) -> int:
        """Side of the resized input image: the stock ``calculate_dimensions(area, 1)``, a multiple of 32 (and of
        the 2x2-packed latents' cell)."""
        side = round(self.config.condition_area**0.5 / 32) * 32
        return side // (2 * self.pipe.vae_scale_factor) * (2 * self.pipe.vae_scale_factor)

    def _img_shapes(self, n: int) -> list[list[tuple[int, int, int]]]:
        cell = self.condition_size // self.pipe.vae_scale_factor // 2
        return [[(1, self._side, self._side), (1, cell, cell)]] * n

    # ------------------------------------------------------------------------------------------------------ model
    @torch.no_grad()
    def _inputs(self, batch: PromptBatch) -> dict[str, torch.Tensor]:
        """Per sample: text states of the instruction with its image (``prompt_embeds`` `[N, T, D]`, ``prompt_mask``),
        the negative prompt's with the same image under true CFG, and ``image_latents`` `[N, L', 4C]`; each distinct
        (instruction, image) encoded once, in one call of the pipeline's ``encode_prompt`` as the stock pipeline."""
        pipe, size = self.pipe, self.condition_size
        images = [row[0] for row in batch_images(batch, "qwen_image_edit", most=1)]
        position: dict[tuple, int] = {}
        prompts, resized = [], []
        for prompt, image in zip(batch.prompts, images):
            if (prompt, image_key(image)) not in position:
                position[prompt, image_key(image)] = len(position)
                prompts.append(prompt)
                resized.append(pipe.image_processor.resize(to_pil(to_pixels(image)), size, size))
        index = torch.tensor([position[p, image_key(i)] for p, i in zip(batch.prompts, images)])  # [N]
        out = dict(zip(("prompt_embeds", "prompt_mask"), self._encode_with(prompts, resized)))
        if self.do_cfg:
            negative = self._encode_with([self.config.negative_prompt] * len(prompts), resized)
            out.update(negative_prompt_embeds=negative[0], negative_prompt_mask=negative[1])
        pixels = pipe.image_processor.preprocess(resized, size, size).unsqueeze(2)  # [U, 3, 1, S, S] in [-1, 1]
        z = pipe._encode_vae_image(pixels.to(self.device, pipe.vae.dtype), generator=None).float()  # [U, C, 1, s, s]
        out["image_latents"] = pipe._pack_latents(z, len(prompts), z.shape[1], z.shape[3], z.shape[4])  # [U, L', 4C]
        return {k: v[index.to(v.device)] for k, v in out.items()}

    @torch.no_grad()
    def _encode_with(self, prompts: list[str], images: list) -> tuple[torch.Tensor, torch.Tensor]:
        embeds, mask = self.pipe.encode_prompt(prompt=prompts, image=images, device=self.device,
                                               max_sequence_length=self.config.max_sequence_length)
        if mask is None:  # the pipeline drops an all-ones mask
            mask = torch.ones(embeds.shape[:2], dtype=torch.long, device=embeds.device)
        return embeds, mask

    def velocity(self, latents, sigma, embeds, guidance: bool = True) -> torch.Tensor:
        """Velocity `[n, L, 4C]` for packed latents `[n, L, 4C]` at noise level `sigma`: the transformer reads the
        latents' tokens then the image's and the first `L` output tokens are kept; true CFG (the negative prompt with
        the same image, rescaled) unless ``guidance=False``."""
        n, length = latents.shape[:2]
        timestep = (sigma * self.pipe.scheduler.config.num_train_timesteps).to(self.device).expand(n) / 1000
        x = torch.cat([latents, embeds["image_latents"].to(latents.dtype)], dim=1)  # [n, L + L', 4C]
        v = self._forward(x, timestep, embeds["prompt_embeds"], embeds["prompt_mask"])[:, :length]
        if not (self.do_cfg and guidance):
            return v
        v_neg = self._forward(x, timestep, embeds["negative_prompt_embeds"], embeds["negative_prompt_mask"])
        return rescaled_cfg(v, v_neg[:, :length], self.config.true_cfg_scale)

    def _noise(self, count: int, generator: torch.Generator | None) -> torch.Tensor:
        """Initial packed latents `[count, L, 4C]`, drawn as `QwenImageEditPipeline` draws them (the image's encoding
        draws nothing)."""
        size, channels = self.config.resolution, self.pipe.transformer.config.in_channels // 4
        return self.pipe.prepare_latents(None, count, channels, size, size, torch.float32, self.device, generator)[0]


PLUGIN = QwenImageEditPolicy
