"""Qwen-Image-Edit and Qwen-Image-Edit-Plus (instruction-based image editing on Qwen-Image's MMDiT) as a stochastic
policy, with LoRA and true CFG.

Wraps diffusers' `QwenImageEditPipeline` (one input image) or `QwenImageEditPlusPipeline` (Qwen-Image-Edit-2509 /
2511: several input images per prompt): Qwen-Image's components plus the Qwen2.5-VL ``processor``. A prompt is an
instruction with its input image(s) (``conditions["images"]`` of the prompt batch: the ``input_images`` capability).
As the stock pipelines do it: Qwen2.5-VL reads the images with the instruction through the edit template (and with the
negative prompt for true CFG), so the text states depend on the images (Edit: the image resized as the VAE's; Plus:
each image resized to about `vision_area` pixels, ``Picture k`` in the template, one prompt per call); the VAE encodes
each image resized to about `condition_area` pixels (its mode, per-channel mean / std) and their packed tokens follow
the noisy latents' in the transformer's input, ``img_shapes`` naming every grid; the velocity is the output's first
`L` tokens. Text states and image latents are computed once per distinct (instruction, images) at sampling and kept
in the trajectory. Noise levels, true CFG with its norm rescale, and decoding are the `qwen_image` adapter's
([`mmgrpo.pipelines.qwen_image.QwenImagePolicy`]).

Difference from the stock pipelines: the input images are resized to squares (the stock pipelines keep each image's
aspect ratio), so the images of a batch share one token grid; the prompts of a batch have equally many images.
Model and report: https://github.com/QwenLM/Qwen-Image , https://arxiv.org/abs/2508.02324
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from mmgrpo.pipelines._edit_images import CAPABILITY, batch_images, image_key, to_pil, to_pixels
from mmgrpo.hub import resolve_pretrained
from mmgrpo.model_limits import read_json
from mmgrpo.pipelines._flow_common import check_packing
from mmgrpo.pipelines._flow_policy import load_flow_pipeline
from mmgrpo.pipelines.qwen_image import QwenImageConfig, QwenImagePolicy, rescaled_cfg
from mmgrpo.types import PromptBatch
from mmgrpo.validation import check_range


PIPELINES = ("QwenImageEditPipeline", "QwenImageEditPlusPipeline")


def side_of(area: int, multiple: int) -> int:
    """The side of the square of about `area` pixels, as the stock ``calculate_dimensions(area, 1)`` (a multiple of
    32), rounded down to `multiple`."""
    return round(area**0.5 / 32) * 32 // multiple * multiple


@dataclass
class QwenImageEditConfig(QwenImageConfig):
    """Options of [`QwenImageEditPolicy`]: those of [`~mmgrpo.pipelines.qwen_image.QwenImageConfig`] (``pretrained``:
    a diffusers Qwen-Image-Edit folder or hub id, e.g. ``Qwen/Qwen-Image-Edit``), and:

    Args:
        condition_area (`int`, defaults to 1048576): pixels of the resized input image(s) the VAE encodes (both
            stock pipelines' 1024 x 1024); its side is ``round(sqrt(area) / 32) * 32``.
        vision_area (`int`, defaults to 147456): with Edit-Plus, pixels of the input images Qwen2.5-VL reads with the
            instruction (the stock 384 x 384); Qwen-Image-Edit gives it the VAE's resized image.
        pipeline_class (`str`): ``QwenImageEditPipeline`` (one input image) or ``QwenImageEditPlusPipeline``
            (Qwen-Image-Edit-2509 / 2511: several input images per prompt, each ``Picture k`` in the template);
            ``auto`` reads the model's ``model_index.json``.
    """

    condition_area: int = 1024 * 1024
    vision_area: int = 384 * 384
    pipeline_class: Literal["auto", "QwenImageEditPipeline", "QwenImageEditPlusPipeline"] = "auto"

    def __post_init__(self):
        super().__post_init__()
        check_range("condition_area", self.condition_area, 32 * 32, 4096 * 4096, fix="the stock pipeline uses 1048576")
        check_range("vision_area", self.vision_area, 32 * 32, 4096 * 4096, fix="the stock Edit-Plus uses 147456")
        if self.pipeline_class == "auto" and self.pipeline_name() not in PIPELINES:
            raise ValueError(f"pipeline_class: auto cannot tell the Qwen-Image-Edit pipeline of {self.pretrained} "
                             f"(model_index.json names {self.pipeline_name()!r}); set it to one of {list(PIPELINES)}.")

    def pipeline_name(self) -> str:
        """The diffusers pipeline class name (``auto`` resolved from the model's ``model_index.json``)."""
        if self.pipeline_class != "auto":
            return self.pipeline_class
        location = resolve_pretrained(self.pretrained, "pipeline.pretrained")
        return read_json(location, "model_index.json").get("_class_name")


class QwenImageEditPolicy(QwenImagePolicy):
    """Qwen-Image-Edit as a policy: `sample` draws SDE/ODE trajectories of packed latents `[N, L, 4C]` conditioned on
    each prompt's input image (the trajectory keeps ``latents``, the image-aware text states with their masks and the
    packed ``image_latents`` `[N, L', 4C]`), `log_prob` replays their transitions, `likelihood` scores the final
    latents; outputs ``images`` `[N, 3, H, W]` in [0, 1]."""

    Config = QwenImageEditConfig
    capabilities = frozenset({CAPABILITY})  # reads conditions["images"]: one input image per prompt
    input_names = QwenImagePolicy.input_names + ("image_latents",)

    def __init__(self, config: QwenImageEditConfig):
        from diffusers import QwenImageEditPipeline, QwenImageEditPlusPipeline

        self.config = config
        self.plus = config.pipeline_name() == "QwenImageEditPlusPipeline"  # several input images per prompt
        self.flow = load_flow_pipeline(QwenImageEditPlusPipeline if self.plus else QwenImageEditPipeline, config)
        self.pipe = self.flow.pipe
        check_packing(self.pipe, config, "packing")
        self.trainable = self.flow.experts[0]
        self.transformer = self.trainable.module
        self.device = torch.device("cpu")

    @property
    def condition_size(self) -> int:
        """Side of the input image(s) the VAE encodes (a multiple of the 2x2-packed latents' cell)."""
        return side_of(self.config.condition_area, 2 * self.pipe.vae_scale_factor)

    def _img_shapes(self, x: torch.Tensor) -> list[list[tuple[int, int, int]]]:
        """The output's token grid, then one grid per input image (their tokens follow the latents' in `x`)."""
        cell = self.condition_size // self.pipe.vae_scale_factor // 2
        count = (x.shape[1] - self._side**2) // cell**2  # input images
        return [[(1, self._side, self._side)] + [(1, cell, cell)] * count] * x.shape[0]

    # ------------------------------------------------------------------------------------------------------ model
    @torch.no_grad()
    def _inputs(self, batch: PromptBatch) -> dict[str, torch.Tensor]:
        """Per sample: text states of the instruction with its image(s) (``prompt_embeds`` `[N, T, D]`,
        ``prompt_mask``), the negative prompt's with the same images under true CFG, and ``image_latents``
        `[N, k L', 4C]` (`k` input images); each distinct (instruction, images) encoded once."""
        rows = batch_images(batch, "qwen_image_edit", most=None if self.plus else 1)
        if len({len(row) for row in rows}) > 1:
            raise ValueError("qwen_image_edit: the prompts of a batch need the same number of input images (their "
                             "tokens are stacked); give every row of the data as many images.")
        keys = [(p, tuple(image_key(i) for i in row)) for p, row in zip(batch.prompts, rows)]
        position: dict[tuple, int] = {}
        prompts, uniques = [], []
        for key, row in zip(keys, rows):
            if key not in position:
                position[key] = len(position)
                prompts.append(key[0])
                uniques.append([to_pil(to_pixels(image)) for image in row])
        index = torch.tensor([position[key] for key in keys])  # [N]
        out = self._text_states(prompts, uniques)
        out["image_latents"] = torch.cat([self._image_latents(row) for row in uniques])  # [U, k L', 4C]
        return {k: v[index.to(v.device)] for k, v in out.items()}

    def _text_states(self, prompts: list[str], rows: list[list]) -> dict[str, torch.Tensor]:
        """The text states `[U, T, D]` and masks `[U, T]` of each instruction with its images (and of the negative
        prompt with them under true CFG): Qwen-Image-Edit encodes the batch in one call, its image resized as the
        VAE's; Edit-Plus one prompt at a time (as its stock pipeline), its images resized to `vision_area`."""
        names = ("prompt_embeds", "prompt_mask", "negative_prompt_embeds", "negative_prompt_mask")
        texts = [prompts] + [[self.config.negative_prompt] * len(prompts)] * self.do_cfg
        out = {}
        for text, keys in zip(texts, (names[:2], names[2:])):
            if not self.plus:
                size = self.condition_size
                views = [self.pipe.image_processor.resize(row[0], size, size) for row in rows]
                out.update(zip(keys, self._encode_with(text, views)))
                continue
            size = side_of(self.config.vision_area, 32)
            states = [self._encode_with([t], [self.pipe.image_processor.resize(i, size, size) for i in row])
                      for t, row in zip(text, rows)]
            length = max(e.shape[1] for e, _ in states)
            out[keys[0]] = torch.cat([F.pad(e, (0, 0, 0, length - e.shape[1])) for e, _ in states])  # [U, T, D]
            out[keys[1]] = torch.cat([F.pad(m, (0, length - m.shape[1])) for _, m in states])  # [U, T]
        return out

    @torch.no_grad()
    def _image_latents(self, row: list) -> torch.Tensor:
        """One prompt's input images -> their packed latents side by side, `[1, k L', 4C]` (the VAE's mode, normalised
        as the stock pipelines)."""
        pipe, size = self.pipe, self.condition_size
        packed = []
        for image in row:
            if not self.plus:  # Qwen-Image-Edit preprocesses its resized image, Edit-Plus the original
                image = pipe.image_processor.resize(image, size, size)
            pixels = pipe.image_processor.preprocess(image, size, size).unsqueeze(2)  # [1, 3, 1, S, S] in [-1, 1]
            z = pipe._encode_vae_image(pixels.to(self.device, pipe.vae.dtype), generator=None).float()  # [1, C, 1, s, s]
            packed.append(pipe._pack_latents(z, 1, z.shape[1], z.shape[3], z.shape[4]))  # [1, L', 4C]
        return torch.cat(packed, dim=1)

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
