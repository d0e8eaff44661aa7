"""LAION improved aesthetic predictor: an MLP head (1-10 scale) on L2-normalised CLIP ViT-L/14 image embeddings.

Head: https://github.com/christophschuhmann/improved-aesthetic-predictor (``sac+logos+ava1-l14-linearMSE.pth``), the
aesthetic reward of DDPO (https://arxiv.org/abs/2305.13301) and Flow-GRPO. The head is five linear layers 768 -> 1024 ->
128 -> 64 -> 16 -> 1 with dropouts 0.2, 0.2, 0.1 after the first three and no activations, exactly as published (its
state-dict keys ``layers.0``, ``layers.2``, ``layers.4``, ``layers.6``, ``layers.7``). The input width is read from the
head file, so a head trained on another CLIP loads the same way. A video (``modality: video``) is scored frame by frame,
every `frame_stride`-th frame, and reduced by `frame_reduce` (mean, min or first frame).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from mmgrpo.rewards import _clip
from mmgrpo.rewards._common import (
    check_frame_options, fixed_artifacts, frames, modality_option, non_finite_samples, reduce_frames,
)
from mmgrpo.types import PromptBatch, RewardResult
from mmgrpo.validation import check_fields

HEAD_FILE = "sac+logos+ava1-l14-linearMSE.pth"
HEAD_URL = "https://github.com/christophschuhmann/improved-aesthetic-predictor"
HIDDEN = (1024, 128, 64, 16)


def laion_head(embed_dim: int = 768) -> nn.Sequential:
    """The improved aesthetic predictor's MLP (random weights, eval mode): `[M, embed_dim]` -> `[M, 1]`."""
    return nn.Sequential(
        nn.Linear(embed_dim, HIDDEN[0]),
        nn.Dropout(0.2),
        nn.Linear(HIDDEN[0], HIDDEN[1]),
        nn.Dropout(0.2),
        nn.Linear(HIDDEN[1], HIDDEN[2]),
        nn.Dropout(0.1),
        nn.Linear(HIDDEN[2], HIDDEN[3]),
        nn.Linear(HIDDEN[3], 1),
    ).eval()


def load_head(path: str) -> nn.Sequential:
    """Loads a head file (``torch.save`` state dict, keys with or without the ``layers.`` prefix, or safetensors)."""
    if path.endswith(".safetensors"):
        from safetensors.torch import load_file

        state = load_file(path)
    else:
        state = torch.load(path, map_location="cpu", weights_only=True)
    state = {k[len("layers."):] if k.startswith("layers.") else k: v for k, v in state.items()}
    if "0.weight" not in state:
        raise ValueError(
            f"aesthetic.head_path={path!r} is not an improved-aesthetic-predictor head (no layers.0.weight among "
            f"{sorted(state)[:6]}); use {HEAD_FILE} from {HEAD_URL}."
        )
    head = laion_head(state["0.weight"].shape[1])
    head.load_state_dict(state)
    return head.requires_grad_(False)


@dataclass
class AestheticScoreConfig:
    """Configuration of [`AestheticScore`].

    Args:
        head_path (`str`): the head weights file, ``sac+logos+ava1-l14-linearMSE.pth`` from the
            improved-aesthetic-predictor repository (required; nothing is downloaded).
        model_name (`str`, defaults to `"ViT-L-14"`): the CLIP the head was trained on, as in `clip_score`.
        pretrained (`str`, *optional*, defaults to `"openai"`): its open_clip tag or a local checkpoint file.
        modality (`str`, defaults to `"image"`): ``"image"`` or ``"video"`` (scored frame by frame).
        frame_stride (`int`, defaults to 1): with ``modality: video``, scores frames ``0, k, 2k, ...`` (k = the stride).
        frame_reduce (`str`, defaults to `"mean"`): with ``modality: video``, a sample's score from its frames' scores:
            ``"mean"``, ``"min"`` or ``"first"`` (frame 0 only; the other frames are not scored).
        batch_size (`int`, defaults to 32): images per CLIP forward.
        device (`str`, defaults to `"auto"`): where CLIP and the head run.
    """

    head_path: str | None = None
    model_name: str = "ViT-L-14"
    pretrained: str | None = "openai"
    modality: Literal["image", "video"] = "image"
    frame_stride: int = 1
    frame_reduce: Literal["mean", "min", "first"] = "mean"
    batch_size: int = 32
    device: str = "auto"

    def __post_init__(self):
        check_fields(self)
        check_frame_options("aesthetic", self.modality, self.frame_stride, self.frame_reduce)
        if not self.head_path or not os.path.isfile(os.path.expanduser(self.head_path)):
            where = "is not set" if not self.head_path else f"={self.head_path!r} does not exist"
            raise ValueError(
                f"aesthetic.head_path {where}: the reward needs the LAION improved aesthetic predictor head "
                f"{HEAD_FILE} (from {HEAD_URL}); download it and set head_path to its path (reward.head_path=... "
                f"in an experiment config)."
            )
        _clip.check_options("aesthetic", self)


class AestheticScore:
    """Scores ``outputs["images"]`` `[N, 3, H, W]` (or ``outputs["videos"]`` `[N, F, 3, H, W]`) with the LAION head."""

    Config = AestheticScoreConfig
    modalities = frozenset({"image"})  # the default; an instance holds its configured modality
    group_stage = None  # each score depends on its sample only (see mmgrpo.protocols.RewardFn)
    artifacts = frozenset()  # adds nothing for the sample writers

    modalities_for = classmethod(modality_option)  # see mmgrpo.protocols.RewardFn
    artifacts_for = classmethod(fixed_artifacts)

    def __init__(self, config: AestheticScoreConfig):
        self.config = config
        self.modalities = self.modalities_for(config)
        self.model, _ = _clip.load_open_clip("aesthetic", config.model_name, config.pretrained, config.device)
        self.head = load_head(os.path.expanduser(config.head_path))
        width = self.model.visual.output_dim
        if self.head[0].in_features != width:
            raise ValueError(
                f"aesthetic: the head in {config.head_path} takes {self.head[0].in_features}-d embeddings but "
                f"{config.model_name} gives {width}-d ones; use the CLIP the head was trained on (ViT-L-14, openai "
                f"for {HEAD_FILE})."
            )

    @torch.no_grad()
    def __call__(self, outputs: dict[str, Any], batch: PromptBatch) -> RewardResult:
        """Returns `scores` `[N]` (the head's rating; a video's frame ratings reduced by `frame_reduce`) and
        `components` ``malformed`` (1 where the pixels held NaN or infinity; those are scored as if they were 0)."""
        cfg = self.config
        pixels, per_sample = frames(outputs, cfg.modality, "aesthetic", cfg.frame_stride, cfg.frame_reduce)
        embeddings = _clip.image_embeddings(pixels, self.model, cfg.batch_size)  # [N * F', D]
        ratings = self.head(embeddings).squeeze(-1)  # [N * F']
        scores = reduce_frames(ratings, per_sample, cfg.frame_reduce)  # [N]
        return RewardResult(scores=scores.float(), components={"malformed": non_finite_samples(outputs, cfg.modality)})


PLUGIN = AestheticScore
