"""HPSv2 / HPSv2.1: Human Preference Score v2, an open_clip ViT-H-14 fine-tuned on human preferences (HPD v2).

Paper: https://arxiv.org/abs/2306.09341; code https://github.com/tgxs002/HPSv2 (``hpsv2/img_score.py``); weights
``HPS_v2.1_compressed.pt`` (and ``HPS_v2_compressed.pt``) in the hub repository ``xswu/HPSv2``. As the authors
compute it, the score is the cosine similarity of the L2-normalised image and text features (no logit scale):

    hps = <f_img(x) / |f_img(x)|, f_txt(p) / |f_txt(p)|>      (about 0.2 to 0.35 for real images)

times `scale` (1 reproduces the authors' number; papers often print it times 100). The preprocessing is the
authors' validation transform (their fork of open_clip, ``image_transform(is_train=False)``): the image as a float
tensor, resized on the tensor so its shorter side is the model's image size (bicubic, antialiased, no clamping),
centre-cropped, and normalised with OpenAI CLIP's mean and std; prompts go through open_clip's tokenizer (77
tokens). Differences from the authors' code: the model runs in float32 (they use fp16 autocast), images come as
tensors in [0, 1] (theirs are PIL images; an 8-bit image gives the same tensor), and the checkpoint is read without
pickle code (``torch.load(weights_only=True)`` or safetensors). A video (``modality: video``) is scored frame by
frame, every `frame_stride`-th frame, and reduced by `frame_reduce`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F

from mmgrpo.hub import is_hub_id
from mmgrpo.rewards import _clip
from mmgrpo.rewards._common import (
    BATCH_LIMIT, WEIGHT_LIMIT, check_frame_options, fixed_artifacts, frames, modality_option, non_finite_samples,
    reduce_frames, weights_path,
)
from mmgrpo.types import PromptBatch, RewardResult
from mmgrpo.validation import ConfigError, check_fields, check_range, check_text

HUB_REPO = "xswu/HPSv2"
WEIGHT_SUFFIXES = (".pt", ".pth", ".bin", ".safetensors")


def load_state_dict(path: str) -> dict[str, torch.Tensor]:
    """The open_clip state dict of an HPS checkpoint (``{"state_dict": ...}`` as the authors save it, or a plain
    state dict), read without running pickle code; a ``module.`` prefix (DDP) is dropped."""
    if path.endswith(".safetensors"):
        from safetensors.torch import load_file

        state = load_file(path)
    else:
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as err:  # a pickle that needs code to load, or not a torch file
            raise ValueError(
                f"hpsv2.checkpoint: {path} does not load as plain tensors ({err}); use HPS_v2.1_compressed.pt from "
                f"{HUB_REPO} or a safetensors export of its state dict."
            ) from err
    state = state.get("state_dict", state) if isinstance(state, dict) else state
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ValueError(f"hpsv2.checkpoint: {path} holds no state dict of tensors (got {type(state).__name__}).")
    return {k[len("module."):] if k.startswith("module.") else k: v for k, v in state.items()}


def hps_preprocess(images: torch.Tensor, size: int, device) -> torch.Tensor:
    """The authors' validation transform on tensors: `images` `[M, 3, H, W]` in [0, 1] -> `[M, 3, size, size]`
    (shorter side resized to `size` as torchvision's ``Resize(size)``, bicubic with antialiasing, not clamped;
    ``CenterCrop(size)``; OpenAI CLIP normalisation)."""
    from open_clip.constants import OPENAI_DATASET_MEAN, OPENAI_DATASET_STD
    from torchvision.transforms import InterpolationMode
    from torchvision.transforms import functional as TF

    images = TF.resize(images.to(device), size, interpolation=InterpolationMode.BICUBIC, antialias=True)
    images = TF.center_crop(images, size)  # [M, 3, size, size]
    return TF.normalize(images, OPENAI_DATASET_MEAN, OPENAI_DATASET_STD)


@dataclass
class HPSv2Config:
    """Configuration of [`HPSv2`].

    Args:
        checkpoint (`str`, defaults to `"xswu/HPSv2"`): the HPS weights: a file (``.pt`` as the authors save it, or
            ``.safetensors``), a folder holding `filename`, or a hub repository id holding `filename`.
        filename (`str`, defaults to `"HPS_v2.1_compressed.pt"`): the weights file within a folder or hub
            repository (``"HPS_v2_compressed.pt"`` for HPSv2.0).
        model_name (`str`, defaults to `"ViT-H-14"`): the open_clip architecture the checkpoint fits (a built-in name
            or ``"local-dir:<folder>"`` with ``open_clip_config.json``); its own pretrained weights are not loaded.
        scale (`float`, defaults to 1.0): the score is ``scale * cos`` (1: the authors' number; 100: as papers print).
        modality (`str`, defaults to `"image"`): ``"image"`` or ``"video"`` (scored frame by frame).
        frame_stride (`int`, defaults to 1): with ``modality: video``, scores frames ``0, k, 2k, ...`` (k = the stride).
        frame_reduce (`str`, defaults to `"mean"`): with ``modality: video``, a sample's score from its frames' scores:
            ``"mean"``, ``"min"`` or ``"first"`` (frame 0 only; the other frames are not scored).
        batch_size (`int`, defaults to 32): images per forward.
        device (`str`, defaults to `"auto"`): where the model runs (``"auto"``: CUDA when available).
    """

    checkpoint: str = HUB_REPO
    filename: str = "HPS_v2.1_compressed.pt"
    model_name: str = "ViT-H-14"
    scale: float = 1.0
    modality: Literal["image", "video"] = "image"
    frame_stride: int = 1
    frame_reduce: Literal["mean", "min", "first"] = "mean"
    batch_size: int = 32
    device: str = "auto"

    def __post_init__(self):
        check_fields(self)
        check_frame_options("hpsv2", self.modality, self.frame_stride, self.frame_reduce)
        for key, value in (("checkpoint", self.checkpoint), ("filename", self.filename), ("device", self.device)):
            check_text(f"hpsv2.{key}", value)
        check_range("hpsv2.scale", self.scale, 0, WEIGHT_LIMIT, low_open=True, fix="1 as the authors, 100 as papers print")
        check_range("hpsv2.batch_size", self.batch_size, 1, BATCH_LIMIT, fix="images per forward")
        if not self.filename.endswith(WEIGHT_SUFFIXES) or "/" in self.filename:
            raise ConfigError(f"hpsv2.filename={self.filename!r} must be a file name ending in one of "
                              f"{WEIGHT_SUFFIXES}, e.g. 'HPS_v2.1_compressed.pt'.")
        path = os.path.expanduser(self.checkpoint)
        if os.path.isfile(path) and not path.endswith(WEIGHT_SUFFIXES):
            raise ConfigError(f"hpsv2.checkpoint={self.checkpoint!r} is not a weights file ({WEIGHT_SUFFIXES}).")
        if os.path.isdir(path) and not os.path.isfile(os.path.join(path, self.filename)):
            raise ConfigError(f"hpsv2.checkpoint={self.checkpoint!r} has no {self.filename}; download it from "
                              f"{HUB_REPO} into that folder or set hpsv2.filename.")
        if not os.path.exists(path) and not is_hub_id(self.checkpoint):
            raise ConfigError(f"hpsv2.checkpoint={self.checkpoint!r} does not exist and is not a hub id; give the "
                              f"file {self.filename}, its folder, or the hub id {HUB_REPO!r}.")
        check_text("hpsv2.model_name", self.model_name)
        _clip.check_source("hpsv2", self.model_name, None)


class HPSv2:
    """Scores ``outputs["images"]`` `[N, 3, H, W]` (or ``outputs["videos"]`` `[N, F, 3, H, W]`) against the prompts."""

    Config = HPSv2Config
    modalities = frozenset({"image"})  # the default; an instance holds its configured modality
    group_stage = None  # each score depends on its sample only (see mmgrpo.protocols.RewardFn)
    artifacts = frozenset()  # adds nothing for the sample writers

    modalities_for = classmethod(modality_option)  # see mmgrpo.protocols.RewardFn
    artifacts_for = classmethod(fixed_artifacts)

    def __init__(self, config: HPSv2Config | None = None):
        self.config = config or HPSv2Config()
        self.modalities = self.modalities_for(self.config)
        cfg = self.config
        path = weights_path(cfg.checkpoint, cfg.filename, reward="hpsv2", option="checkpoint", hub_repo=HUB_REPO)
        state = load_state_dict(path)
        self.model, self.tokenizer = _clip.load_open_clip("hpsv2", cfg.model_name, None, cfg.device)
        try:
            self.model.load_state_dict(state)
        except RuntimeError as err:
            raise ValueError(
                f"hpsv2: {path} does not fit open_clip {cfg.model_name!r} ({str(err)[:300]}); HPSv2 checkpoints are "
                f"ViT-H-14 (hpsv2.model_name: ViT-H-14)."
            ) from err
        self.size = self.model.visual.image_size[0] if isinstance(self.model.visual.image_size, tuple) \
            else self.model.visual.image_size

    @torch.no_grad()
    def _image_features(self, pixels: torch.Tensor) -> torch.Tensor:
        """L2-normalised image features `[M, D]` (float32, CPU) of `pixels` `[M, 3, H, W]` in [0, 1]."""
        device = next(self.model.parameters()).device
        chunks = [
            F.normalize(self.model.encode_image(hps_preprocess(pixels[i : i + self.config.batch_size], self.size,
                                                               device)).float(), dim=-1).cpu()
            for i in range(0, pixels.shape[0], self.config.batch_size)
        ]
        return torch.cat(chunks)

    def __call__(self, outputs: dict[str, Any], batch: PromptBatch) -> RewardResult:
        """Returns `scores` `[N]` (``scale * cos``; a video's frame scores reduced by `frame_reduce`) and `components`
        ``cosine`` (the authors' HPS, reduced the same way) and ``malformed`` (non-finite pixels, scored as 0)."""
        cfg = self.config
        pixels, per_sample = frames(outputs, cfg.modality, "hpsv2", cfg.frame_stride, cfg.frame_reduce)
        prompts = [p for p in batch.prompts for _ in range(per_sample)]
        image = self._image_features(pixels)  # [N * F', D]
        text = _clip.text_embeddings(prompts, self.model, self.tokenizer, cfg.batch_size)  # [N * F', D]
        cosine = reduce_frames((image * text).sum(dim=-1), per_sample, cfg.frame_reduce)  # [N]
        return RewardResult(scores=(cfg.scale * cosine).float(),
                            components={"cosine": cosine, "malformed": non_finite_samples(outputs, cfg.modality)})


PLUGIN = HPSv2
