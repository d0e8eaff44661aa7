"""CLIP score: image-prompt cosine similarity of an open_clip model, scaled as CLIPScore (w * max(cos, 0)).

CLIPScore: https://arxiv.org/abs/2104.08718 (w = 2.5; torchmetrics' `CLIPScore` uses w = 100). Images are resized
(shorter side, bicubic), centre-cropped and normalised as open_clip's eval transform does, on tensors. A video
(``modality: video``) is scored frame by frame, every `frame_stride`-th frame, and reduced by `frame_reduce` (mean, min
or first frame).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from mmgrpo.rewards import _clip
from mmgrpo.rewards._common import (
    WEIGHT_LIMIT, check_frame_options, fixed_artifacts, frames, modality_option, non_finite_samples, reduce_frames,
)
from mmgrpo.types import PromptBatch, RewardResult
from mmgrpo.validation import check_fields, check_range


@dataclass
class ClipScoreConfig:
    """Configuration of [`ClipScore`].

    Args:
        model_name (`str`, defaults to `"ViT-L-14"`): an open_clip model name, ``"local-dir:<folder>"`` (a folder
            holding ``open_clip_config.json`` and the weights) or ``"hf-hub:org/repo"``.
        pretrained (`str`, *optional*, defaults to `"openai"`): an open_clip pretrained tag (downloaded through the
            hub) or the path of a local checkpoint file of `model_name`; ignored with a ``local-dir:`` name. None
            builds random weights (tests only).
        scale (`float`, defaults to 2.5): the score is ``scale * cos`` (CLIPScore's w).
        clamp_negative (`bool`, defaults to `True`): ``max(cos, 0)`` as CLIPScore does.
        modality (`str`, defaults to `"image"`): ``"image"`` or ``"video"`` (scored frame by frame).
        frame_stride (`int`, defaults to 1): with ``modality: video``, scores frames ``0, k, 2k, ...`` (k = the stride).
        frame_reduce (`str`, defaults to `"mean"`): with ``modality: video``, a sample's score from its frames' scores:
            ``"mean"``, ``"min"`` or ``"first"`` (frame 0 only; the other frames are not scored).
        batch_size (`int`, defaults to 32): images per CLIP forward.
        device (`str`, defaults to `"auto"`): where the CLIP model runs (``"auto"``: CUDA when available).
    """

    model_name: str = "ViT-L-14"
    pretrained: str | None = "openai"
    scale: float = 2.5
    clamp_negative: bool = True
    modality: Literal["image", "video"] = "image"
    frame_stride: int = 1
    frame_reduce: Literal["mean", "min", "first"] = "mean"
    batch_size: int = 32
    device: str = "auto"

    def __post_init__(self):
        check_fields(self)
        check_frame_options("clip_score", self.modality, self.frame_stride, self.frame_reduce)
        check_range("clip_score.scale", self.scale, 0, WEIGHT_LIMIT, low_open=True, fix="2.5 as CLIPScore")
        _clip.check_options("clip_score", self)


class ClipScore:
    """Scores ``outputs["images"]`` `[N, 3, H, W]` (or ``outputs["videos"]`` `[N, F, 3, H, W]`) against the prompts."""

    Config = ClipScoreConfig
    modalities = frozenset({"image"})  # the default; an instance holds its configured modality
    group_stage = None  # each score depends on its sample only (see mmgrpo.protocols.RewardFn)
    artifacts = frozenset()  # adds nothing for the sample writers

    modalities_for = classmethod(modality_option)  # see mmgrpo.protocols.RewardFn
    artifacts_for = classmethod(fixed_artifacts)

    def __init__(self, config: ClipScoreConfig | None = None):
        self.config = config or ClipScoreConfig()
        self.modalities = self.modalities_for(self.config)
        self.model, self.tokenizer = _clip.load_open_clip(
            "clip_score", self.config.model_name, self.config.pretrained, self.config.device
        )

    def __call__(self, outputs: dict[str, Any], batch: PromptBatch) -> RewardResult:
        """Returns `scores` `[N]` and `components` ``cosine`` (raw cosine similarity; a video's frame scores and cosines
        each reduced by `frame_reduce`) and ``malformed`` (1 where the pixels held NaN or infinity; those are scored as
        if they were 0)."""
        cfg = self.config
        pixels, per_sample = frames(outputs, cfg.modality, "clip_score", cfg.frame_stride, cfg.frame_reduce)
        prompts = [p for p in batch.prompts for _ in range(per_sample)]
        image = _clip.image_embeddings(pixels, self.model, cfg.batch_size)  # [N * F', D]
        text = _clip.text_embeddings(prompts, self.model, self.tokenizer, cfg.batch_size)  # [N * F', D]
        cosine = (image * text).sum(dim=-1)  # [N * F']
        per_frame = cfg.scale * (cosine.clamp_min(0) if cfg.clamp_negative else cosine)  # [N * F']
        scores = reduce_frames(per_frame, per_sample, cfg.frame_reduce)  # [N]
        cosine = reduce_frames(cosine, per_sample, cfg.frame_reduce)  # [N]
        return RewardResult(
            scores=scores.float(),
            components={"cosine": cosine.float(), "malformed": non_finite_samples(outputs, cfg.modality)},
        )


PLUGIN = ClipScore
