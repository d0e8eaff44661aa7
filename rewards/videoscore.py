"""VideoScore (Qwen2-VL): a Qwen2-VL video model fine-tuned to regress five human ratings of a generated video,
loaded into transformers' stock `Qwen2VLForConditionalGeneration` and a plain `torch.nn.Linear` head.

Paper: https://arxiv.org/abs/2406.15252; code https://github.com/TIGER-AI-Lab/VideoScore
(``examples/run_videoscore_qwen2_vl.py``) and the model class ``Qwen2VLForSequenceClassification`` of
https://github.com/TIGER-AI-Lab/Mantis (``mantis/models/qwen2_vl/modeling_qwen2_vl.py``); weights and processor in the
hub repository ``TIGER-Lab/VideoScore-Qwen2-VL``. As the authors score a video against its prompt:

    frames = qwen-vl-utils' sampling at 8 fps: n = floor2(min(max(F / video_fps * 8, 4), min(768, F))) frames at
             round(linspace(0, F - 1, n)), resized (bicubic, antialiased) to smart_resize(H, W, 28,
             min 128 * 28 * 28, max max(min(768 * 28 * 28, 24576 * 28 * 28 / n * 2), 1.05 * min)) pixels
    text   = chat template(user: <video> REGRESSION_QUERY_PROMPT(prompt), generation prompt)
    h      = Qwen2-VL decoder's last hidden state (final norm) at the last token before the padding
    scores = score(h)   (Linear hidden -> 5: visual quality, temporal consistency, dynamic degree,
                         text-to-video alignment, factual consistency; each about 1 to 4)

The authors' class embeds the video tokens itself and calls the decoder without position ids, so the decoder runs on
plain 1-D positions (0, 1, 2, ... on every M-RoPE axis); this module passes those positions explicitly. The checkpoint
(keys ``visual.*``, ``model.*``, ``score.*``; no ``lm_head``, which the score never reads) is loaded by
``from_pretrained``; any other weight left unset or unused is an error. The frame-sampling constants are those of
qwen-vl-utils 0.0.8, current when the model was released, written out as options. Differences from the authors' code:
the pipeline's frames are rounded to 8 bits and sampled from the tensor (the authors decode an mp4 file, whose frame
rate `video_fps` stands for); the processor is told not to resize again (its own resize leaves frames of this size
unchanged); the last token is found from the attention mask (the authors look for the first pad token, the same token
unless a prompt contains the pad token's text).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Literal

import torch

from mmgrpo.hub import DTYPES, resolve_pretrained
from mmgrpo.rewards._common import BATCH_LIMIT, fixed_artifacts, fixed_modalities, non_finite_samples, resolve_device
from mmgrpo.types import PromptBatch, RewardResult
from mmgrpo.validation import ConfigError, check_fields, check_range, check_text

HUB_REPO = "TIGER-Lab/VideoScore-Qwen2-VL"
ASPECTS = ("visual_quality", "temporal_consistency", "dynamic_degree", "text_alignment", "factual_consistency")
FACTOR, FRAME_FACTOR = 28, 2  # Qwen2-VL's resize cell and temporal patch
PIXELS_LIMIT = 16384 * 28 * 28  # Qwen2-VL's largest frame
REGRESSION_QUERY_PROMPT = (
    "\nSuppose you are an expert in judging and evaluating the quality of AI-generated videos,\nplease watch the "
    "following frames of a given video and see the text prompt for generating the video,\nthen give scores from 5 "
    "different dimensions:\n(1) visual quality: the quality of the video in terms of clearness, resolution, "
    "brightness, and color\n(2) temporal consistency, both the consistency of objects or humans and the smoothness "
    "of motion or movements\n(3) dynamic degree, the degree of dynamic changes\n(4) text-to-video alignment, the "
    "alignment between the text prompt and the video content\n(5) factual consistency, the consistency of the video "
    "content with the common-sense and factual knowledge\n\nfor each dimension, output a float number from 1.0 to "
    "4.0,\nthe higher the number is, the better the video performs in that sub-score, \nthe lowest 1.0 means Bad, "
    "the highest 4.0 means Perfect/Real (the video is like a real video)\nHere is an output example:\nvisual "
    "quality: 3.2\ntemporal consistency: 2.7\ndynamic degree: 4.0\ntext-to-video alignment: 2.3\nfactual "
    "consistency: 1.8\n\nFor this video, the text prompt is \"{text_prompt}\",\nall the frames of video are as "
    "follows:\n"
)


@dataclass
class VideoScoreConfig:
    """Configuration of [`VideoScore`].

    Args:
        model (`str`, defaults to `"TIGER-Lab/VideoScore-Qwen2-VL"`): folder or hub id of the model and its processor.
        video_fps (`float`, defaults to 16.0): the frame rate of the pipeline's videos (Wan 2.1: 16), from which
            frames are sampled at `fps`.
        fps (`float`, defaults to 8.0): frames per second the model sees (the authors' example: 8).
        min_frames (`int`, defaults to 4): least frames sampled (qwen-vl-utils').
        max_frames (`int`, defaults to 768): most frames sampled (qwen-vl-utils').
        min_pixels (`int`, defaults to 100352): least pixels of a frame (qwen-vl-utils': 128 * 28 * 28).
        max_pixels (`int`, defaults to 602112): most pixels of a frame (qwen-vl-utils': 768 * 28 * 28), further
            capped by `total_pixels` spread over the frames.
        total_pixels (`int`, defaults to 19267584): the pixel budget of a whole video (qwen-vl-utils': 24576 * 28 * 28).
        aspect (`str`, defaults to `"mean"`): the score: ``"mean"`` of the five outputs or one of them.
        dtype (`str`, defaults to `"bfloat16"`): the model's dtype (the checkpoint's).
        batch_size (`int`, defaults to 2): videos per forward.
        device (`str`, defaults to `"auto"`): where the model runs (``"auto"``: CUDA when available).
    """

    model: str = HUB_REPO
    video_fps: float = 16.0
    fps: float = 8.0
    min_frames: int = 4
    max_frames: int = 768
    min_pixels: int = 128 * 28 * 28
    max_pixels: int = 768 * 28 * 28
    total_pixels: int = 24576 * 28 * 28
    aspect: Literal["mean", "visual_quality", "temporal_consistency", "dynamic_degree", "text_alignment",
                    "factual_consistency"] = "mean"
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    batch_size: int = 2
    device: str = "auto"

    def __post_init__(self):
        check_fields(self)
        check_text("videoscore.device", self.device)
        check_range("videoscore.video_fps", self.video_fps, 0, 1000, low_open=True, fix="the videos' frame rate")
        check_range("videoscore.fps", self.fps, 0, 1000, low_open=True, fix="the authors sample 8 frames a second")
        check_range("videoscore.min_frames", self.min_frames, FRAME_FACTOR, 768, fix="qwen-vl-utils uses 4")
        check_range("videoscore.max_frames", self.max_frames, self.min_frames, 768, fix="at least min_frames")
        check_range("videoscore.min_pixels", self.min_pixels, FACTOR * FACTOR, PIXELS_LIMIT, fix="128 * 28 * 28")
        check_range("videoscore.max_pixels", self.max_pixels, self.min_pixels, PIXELS_LIMIT, fix="768 * 28 * 28")
        check_range("videoscore.total_pixels", self.total_pixels, self.min_pixels, 2**31, fix="24576 * 28 * 28")
        check_range("videoscore.batch_size", self.batch_size, 1, BATCH_LIMIT, fix="videos per forward")
        resolve_pretrained(self.model, "videoscore.model")


def sample_frames(videos: torch.Tensor, cfg: VideoScoreConfig) -> torch.Tensor:
    """qwen-vl-utils' (0.0.8) ``fetch_video`` on `videos` `[M, F, 3, H, W]` in [0, 1]: frames sampled at ``cfg.fps``
    from ``cfg.video_fps`` and resized; returns `[M, n, 3, h, w]` float32 in [0, 255]."""
    from qwen_vl_utils.vision_process import ceil_by_factor, floor_by_factor, smart_resize
    from torchvision.transforms import InterpolationMode
    from torchvision.transforms import functional as TF

    total, height, width = videos.shape[1], videos.shape[-2], videos.shape[-1]
    low = ceil_by_factor(cfg.min_frames, FRAME_FACTOR)
    high = floor_by_factor(min(cfg.max_frames, total), FRAME_FACTOR)
    n = floor_by_factor(min(max(total / cfg.video_fps * cfg.fps, low), high, total), FRAME_FACTOR)
    if not FRAME_FACTOR <= n <= total:
        raise ValueError(f"videoscore: a video of {total} frames gives {n} frames; the model needs at least "
                         f"{FRAME_FACTOR} (lower videoscore.min_frames or generate longer videos).")
    index = torch.linspace(0, total - 1, n).round().long()  # [n]
    frames = (videos[:, index].clamp(0, 1) * 255).round().to(torch.uint8)  # [M, n, 3, H, W]
    most = max(min(cfg.max_pixels, cfg.total_pixels / n * FRAME_FACTOR), int(cfg.min_pixels * 1.05))
    new_h, new_w = smart_resize(height, width, FACTOR, min_pixels=cfg.min_pixels, max_pixels=most)
    resized = TF.resize(frames.flatten(0, 1), [new_h, new_w], interpolation=InterpolationMode.BICUBIC,
                        antialias=True).float()  # [M * n, 3, h, w]
    return resized.view(videos.shape[0], n, 3, new_h, new_w)


def model_folder(model: str) -> str:
    """A local folder of `model`: itself, or the hub repository's snapshot (the local cache when offline)."""
    path = resolve_pretrained(model, "videoscore.model")
    if os.path.isdir(path):
        return path
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(path, allow_patterns=["*.json", "*.safetensors", "*.txt", "*.jinja", "*.model"])
    except Exception as err:  # offline, no such repository
        raise RuntimeError(f"videoscore: could not get {model!r} ({err}); download {HUB_REPO} into a folder and set "
                           f"videoscore.model to it.") from err


def score_head(folder: str) -> torch.nn.Linear:
    """The checkpoint's ``score`` layer (``score.weight`` `[5, D]`, ``score.bias`` `[5]`) read from its safetensors."""
    from safetensors import safe_open

    found = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(folder, name), framework="pt") as handle:
                found.update({k: handle.get_tensor(k) for k in handle.keys() if k in ("score.weight", "score.bias")})
    if "score.weight" not in found:
        raise ValueError(f"videoscore: {folder} holds no score.weight; use {HUB_REPO}.")
    weight = found["score.weight"]
    head = torch.nn.Linear(weight.shape[1], weight.shape[0], bias="score.bias" in found)
    head.load_state_dict({k[len("score."):]: v for k, v in found.items()})
    if weight.shape[0] != len(ASPECTS):
        raise ValueError(f"videoscore: the score layer has {weight.shape[0]} outputs, expected {len(ASPECTS)}.")
    return head


class VideoScore:
    """Scores ``outputs["videos"]`` `[N, F, 3, H, W]` against the prompts."""

    Config = VideoScoreConfig
    modalities = frozenset({"video"})
    group_stage = None  # each score depends on its sample only (see mmgrpo.protocols.RewardFn)
    artifacts = frozenset()  # adds nothing for the sample writers

    modalities_for = classmethod(fixed_modalities)  # see mmgrpo.protocols.RewardFn
    artifacts_for = classmethod(fixed_artifacts)

    def __init__(self, config: VideoScoreConfig | None = None):
        from transformers import AutoProcessor, Qwen2VLForConditionalGeneration

        self.config = cfg = config or VideoScoreConfig()
        self.device = resolve_device(cfg.device)
        folder = model_folder(cfg.model)
        self.processor = AutoProcessor.from_pretrained(folder)
        self.processor.tokenizer.padding_side = "right"
        model, info = Qwen2VLForConditionalGeneration.from_pretrained(folder, dtype=DTYPES[cfg.dtype],
                                                                      output_loading_info=True)
        unset = [k for k in info["missing_keys"] if k != "lm_head.weight"]
        unused = [k for k in info["unexpected_keys"] if not k.startswith("score.")]
        if unset or unused or info["mismatched_keys"]:
            raise ValueError(f"videoscore: {cfg.model!r} does not fit Qwen2-VL ({sorted(unset)[:3]} unset, "
                             f"{unused[:3]} unused, {list(info['mismatched_keys'])[:3]} of another shape); use "
                             f"{HUB_REPO}.")
        self.model = model.to(self.device).eval().requires_grad_(False)
        self.head = score_head(folder).to(self.device, DTYPES[cfg.dtype]).eval().requires_grad_(False)

    def texts(self, prompts: list[str]) -> list[str]:
        """The chat texts: one user turn (the video, then the authors' query with the prompt) per prompt."""
        return [self.processor.apply_chat_template(
            [{"role": "user", "content": [{"type": "video"},
                                          {"type": "text", "text": REGRESSION_QUERY_PROMPT.format(text_prompt=p)}]}],
            tokenize=False, add_generation_prompt=True) for p in prompts]

    @torch.no_grad()
    def aspect_scores(self, videos: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        """The five outputs `[M, 5]` (float32, CPU) for videos `[M, F, 3, H, W]` in [0, 1] and their prompts."""
        frames = sample_frames(videos, self.config)  # [M, n, 3, h, w]
        batch = self.processor(text=self.texts(prompts), videos=list(frames), padding=True, return_tensors="pt",
                               videos_kwargs={"do_resize": False}).to(self.device)
        ids, mask = batch["input_ids"], batch["attention_mask"]  # [M, L]
        positions = (mask.long().cumsum(-1) - 1).clamp(min=0)  # [M, L] plain 1-D positions, as the authors' forward
        hidden = self.model.model(
            input_ids=ids, attention_mask=mask, position_ids=positions[None].expand(3, -1, -1),
            pixel_values_videos=batch["pixel_values_videos"].to(self.model.dtype),
            video_grid_thw=batch["video_grid_thw"],
        ).last_hidden_state  # [M, L, D]
        last = mask.sum(dim=1) - 1  # [M] the last token before the (right) padding
        return self.head(hidden[torch.arange(ids.shape[0], device=ids.device), last]).float().cpu()  # [M, 5]

    def __call__(self, outputs: dict[str, Any], batch: PromptBatch) -> RewardResult:
        """Returns `scores` `[N]` (`aspect`: the mean of the five outputs, or one) and `components`, one per aspect
        and ``malformed`` (non-finite pixels, scored as 0)."""
        videos = outputs.get("videos")
        if not isinstance(videos, torch.Tensor) or videos.dim() != 5 or videos.shape[2] != 3:
            raise ValueError("videoscore: expected outputs['videos'] as a tensor [N, F, 3, H, W] in [0, 1].")
        videos = torch.nan_to_num(videos.detach().float(), nan=0.0, posinf=1.0, neginf=0.0)
        size = self.config.batch_size
        out = torch.cat([self.aspect_scores(videos[i : i + size], list(batch.prompts[i : i + size]))
                         for i in range(0, videos.shape[0], size)])  # [N, 5]
        components = {name: out[:, k] for k, name in enumerate(ASPECTS)}
        scores = out.mean(dim=1) if self.config.aspect == "mean" else components[self.config.aspect]
        return RewardResult(scores=scores, components={**components,
                                                       "malformed": non_finite_samples(outputs, "video")})


PLUGIN = VideoScore
