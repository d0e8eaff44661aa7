"""PickScore: a CLIP-H fine-tuned on human preferences (Pick-a-Pic), loaded with transformers' `CLIPModel`.

PickScore: https://arxiv.org/abs/2305.01569 (weights ``yuvalkirstain/PickScore_v1``, processor
``laion/CLIP-ViT-H-14-laion2B-s32B-b79K``). The score is ``logit_scale.exp() * cos(image, prompt)`` (about 17-24 for
real images), divided by `divisor` (Flow-GRPO divides by 26). Images go through the processor's resize (shorter side),
centre crop and normalisation, applied on tensors. A video (``modality: video``) is scored frame by frame, every
`frame_stride`-th frame, and reduced by `frame_reduce` (mean, min or first frame).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch

from mmgrpo.hub import resolve_pretrained
from mmgrpo.rewards._clip import resize_crop_normalize
from mmgrpo.rewards._common import (
    BATCH_LIMIT, WEIGHT_LIMIT, check_frame_options, fixed_artifacts, frames, modality_option, non_finite_samples,
    reduce_frames, resolve_device,
)
from mmgrpo.types import PromptBatch, RewardResult
from mmgrpo.validation import check_fields, check_range, check_text


@dataclass
class PickScoreConfig:
    """Configuration of [`PickScore`].

    Args:
        model (`str`, defaults to `"yuvalkirstain/PickScore_v1"`): a local folder (``config.json`` and weights,
            as `save_pretrained` writes) or a hub id of the `CLIPModel`.
        processor (`str`, *optional*, defaults to `"laion/CLIP-ViT-H-14-laion2B-s32B-b79K"`): folder or hub id of
            the `CLIPProcessor` (tokenizer and image processor); None: the `model` folder.
        divisor (`float`, defaults to 1.0): the score is divided by it (Flow-GRPO: 26).
        modality (`str`, defaults to `"image"`): ``"image"`` or ``"video"`` (scored frame by frame).
        frame_stride (`int`, defaults to 1): with ``modality: video``, scores frames ``0, k, 2k, ...`` (k = the stride).
        frame_reduce (`str`, defaults to `"mean"`): with ``modality: video``, a sample's score from its frames' scores:
            ``"mean"``, ``"min"`` or ``"first"`` (frame 0 only; the other frames are not scored).
        batch_size (`int`, defaults to 32): images per forward.
        device (`str`, defaults to `"auto"`): where the model runs (``"auto"``: CUDA when available).
    """

    model: str = "yuvalkirstain/PickScore_v1"
    processor: str | None = "laion/CLIP-ViT-H-14-laion2B-s32B-b79K"
    divisor: float = 1.0
    modality: Literal["image", "video"] = "image"
    frame_stride: int = 1
    frame_reduce: Literal["mean", "min", "first"] = "mean"
    batch_size: int = 32
    device: str = "auto"

    def __post_init__(self):
        check_fields(self)
        check_frame_options("pickscore", self.modality, self.frame_stride, self.frame_reduce)
        check_text("device", self.device)
        check_range("pickscore.divisor", self.divisor, high=WEIGHT_LIMIT, fix="PickScore logits are ~20 to 30")
        check_range("pickscore.batch_size", self.batch_size, high=BATCH_LIMIT, fix="images per forward")
        if self.divisor <= 0 or self.batch_size < 1:
            raise ValueError(f"pickscore.divisor must be > 0 and batch_size >= 1, got {self.divisor}, {self.batch_size}.")
        resolve_pretrained(self.model, "pickscore.model")
        if self.processor is not None:
            resolve_pretrained(self.processor, "pickscore.processor")


class PickScore:
    """Scores ``outputs["images"]`` `[N, 3, H, W]` (or ``outputs["videos"]`` `[N, F, 3, H, W]`) against the prompts."""

    Config = PickScoreConfig
    modalities = frozenset({"image"})  # the default; an instance holds its configured modality
    group_stage = None  # each score depends on its sample only (see mmgrpo.protocols.RewardFn)
    artifacts = frozenset()  # adds nothing for the sample writers

    modalities_for = classmethod(modality_option)  # see mmgrpo.protocols.RewardFn
    artifacts_for = classmethod(fixed_artifacts)

    def __init__(self, config: PickScoreConfig | None = None):
        from transformers import CLIPModel, CLIPProcessor

        self.config = config or PickScoreConfig()
        self.modalities = self.modalities_for(self.config)
        self.device = resolve_device(self.config.device)
        sources = {"pickscore.model": self.config.model, "pickscore.processor": self.config.processor or self.config.model}
        try:
            self.processor = CLIPProcessor.from_pretrained(resolve_pretrained(sources["pickscore.processor"]))
            self.model = CLIPModel.from_pretrained(resolve_pretrained(sources["pickscore.model"]),
                                                   use_safetensors=True).to(self.device)
        except OSError as err:
            raise RuntimeError(
                f"pickscore: could not load the model or processor from {sources} ({err}). Without network access, "
                f"download yuvalkirstain/PickScore_v1 (config.json, model.safetensors) and the processor files of "
                f"laion/CLIP-ViT-H-14-laion2B-s32B-b79K, and set pickscore.model / pickscore.processor to those "
                f"folders."
            ) from err
        self.model.eval().requires_grad_(False)

    @torch.no_grad()
    def _cosines(self, pixels: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        """Cosine similarity `[M]` of images `[M, 3, H, W]` in [0, 1] and their prompts."""
        image_processor = self.processor.image_processor
        crop = image_processor.crop_size
        pixel_values = resize_crop_normalize(
            pixels, (crop["height"], crop["width"]), image_processor.image_mean, image_processor.image_std, self.device
        )
        text = self.processor.tokenizer(prompts, padding=True, truncation=True, max_length=77, return_tensors="pt")
        out = self.model(pixel_values=pixel_values, **{k: v.to(self.device) for k, v in text.items()})
        return (out.image_embeds * out.text_embeds).sum(dim=-1).float().cpu()  # embeddings are L2-normalised

    def __call__(self, outputs: dict[str, Any], batch: PromptBatch) -> RewardResult:
        """Returns `scores` `[N]` and `components` ``cosine`` (a video's frame scores and cosines each reduced by
        `frame_reduce`) and ``malformed`` (non-finite pixels, scored as 0)."""
        cfg = self.config
        pixels, per_sample = frames(outputs, cfg.modality, "pickscore", cfg.frame_stride, cfg.frame_reduce)
        prompts = [p for p in batch.prompts for _ in range(per_sample)]
        cosine = torch.cat([
            self._cosines(pixels[i : i + cfg.batch_size], prompts[i : i + cfg.batch_size])
            for i in range(0, len(prompts), cfg.batch_size)
        ])  # [N * F']
        per_frame = self.model.logit_scale.exp().float().cpu() * cosine / cfg.divisor  # [N * F']
        return RewardResult(
            scores=reduce_frames(per_frame, per_sample, cfg.frame_reduce),
            components={"cosine": reduce_frames(cosine, per_sample, cfg.frame_reduce),
                        "malformed": non_finite_samples(outputs, cfg.modality)},
        )


PLUGIN = PickScore
