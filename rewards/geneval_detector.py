"""GenEval's object rule (counting, colour, position) on a transformers open-vocabulary detector, for real images.

GenEval (https://arxiv.org/abs/2310.11513, https://github.com/djghosh13/geneval ``evaluation/evaluate_images.py``)
detects the 80 COCO classes with Mask2Former (mmdetection) and classifies the colour of each detection's crop
zero-shot with CLIP ViT-L/14: the crop against ``"a photo of a {c} {class}"``, ``"a photo of a {c}-colored
{class}"`` and ``"a photo of a {c} object"`` for 10 colours (the templates' normalised text embeddings averaged per
colour). The rule on the detections is `mmgrpo.rewards._geneval_rule` (thresholds 0.3, 0.9 for counting prompts, 16
objects per class, no NMS, position threshold 0.1: the authors' defaults). The prompt's clauses come from its
metadata in GenEval's format (``include`` / ``exclude``), as in GenEval's and Flow-GRPO's prompt files.

Differences from the authors' code: the detector is a transformers zero-shot detector (OWLv2 by default, queried
with ``query_template`` for each of GenEval's 80 class names, each box labelled with its best query) instead of
Mask2Former, whose confidences are calibrated differently, so the thresholds may need tuning for the detector. Boxes
only: the colour crop keeps the whole box (GenEval's box detectors do the same; with Mask2Former it greys out the
pixels outside the mask). Crops are clamped to the image (PIL pads them with black). The CLIP transform runs on
tensors (bicubic, antialiased) instead of PIL.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F

from mmgrpo.hub import resolve_pretrained
from mmgrpo.rewards import _clip
from mmgrpo.rewards._common import BATCH_LIMIT, fixed_artifacts, fixed_modalities, frames, nans
from mmgrpo.rewards._geneval_rule import COLORS, OBJECT_NAMES, check_metadata, evaluate, select
from mmgrpo.types import PromptBatch, RewardResult
from mmgrpo.validation import ConfigError, check_fields, check_range, check_template, check_text

COLOR_TEMPLATES = ("a photo of a {c} {name}", "a photo of a {c}-colored {name}", "a photo of a {c} object")
OBJECTS_LIMIT = 1024  # detections kept per class


@dataclass
class GenevalDetectorConfig:
    """Configuration of [`GenevalDetector`].

    Args:
        detector (`str`, defaults to `"google/owlv2-base-patch16-ensemble"`): a local folder (``save_pretrained``
            layout, safetensors weights) or hub id of a transformers zero-shot object detector (OWLv2 or OWL-ViT)
            with its processor.
        query_template (`str`, defaults to `"a photo of a {name}"`): the detector's text query for a class.
        score (`str`, defaults to `"partial"`): the reward, ``"partial"`` (share of the prompt's clauses that hold)
            or ``"strict"`` (1 if all hold, GenEval's ``correct``, else 0). Both are always in `components`.
        threshold (`float`, defaults to 0.3): detections at or below this confidence are dropped (GenEval's).
        counting_threshold (`float`, defaults to 0.9): the same for prompts tagged ``counting`` (GenEval's).
        max_objects (`int`, defaults to 16): detections kept per class, most confident first.
        max_overlap (`float`, defaults to 1.0): greedy NMS IoU within a class (1: no NMS, GenEval's default).
        position_threshold (`float`, defaults to 0.1): share of the two boxes' sizes removed from their centre
            offset before reading a relation (GenEval's).
        clip_model_name (`str`, defaults to `"ViT-L-14"`): the open_clip model that classifies colours, as
            `clip_score.model_name`.
        clip_pretrained (`str`, *optional*, defaults to `"openai"`): its open_clip tag or local checkpoint file.
        batch_size (`int`, defaults to 8): images per detector forward (and crops per CLIP forward x 4).
        device (`str`, defaults to `"auto"`): where both models run (``"auto"``: CUDA when available).
    """

    detector: str = "google/owlv2-base-patch16-ensemble"
    query_template: str = "a photo of a {name}"
    score: Literal["partial", "strict"] = "partial"
    threshold: float = 0.3
    counting_threshold: float = 0.9
    max_objects: int = 16
    max_overlap: float = 1.0
    position_threshold: float = 0.1
    clip_model_name: str = "ViT-L-14"
    clip_pretrained: str | None = "openai"
    batch_size: int = 8
    device: str = "auto"

    def __post_init__(self):
        check_fields(self)
        if self.score not in ("partial", "strict"):
            raise ConfigError(f"geneval_detector.score must be 'partial' or 'strict', got {self.score!r}.")
        check_template("geneval_detector.query_template", self.query_template, name="cat")
        for key, value in (("threshold", self.threshold), ("counting_threshold", self.counting_threshold)):
            check_range(f"geneval_detector.{key}", value, 0, 1, high_open=True, fix="a detector confidence")
        check_range("geneval_detector.max_objects", self.max_objects, 1, OBJECTS_LIMIT, fix="16 as GenEval")
        check_range("geneval_detector.max_overlap", self.max_overlap, 0, 1, low_open=True, fix="1 turns NMS off")
        check_range("geneval_detector.position_threshold", self.position_threshold, 0, 1, fix="0.1 as GenEval")
        check_range("geneval_detector.batch_size", self.batch_size, 1, BATCH_LIMIT, fix="images per detector forward")
        check_text("geneval_detector.device", self.device)
        resolve_pretrained(self.detector, "geneval_detector.detector")
        check_text("geneval_detector.clip_model_name", self.clip_model_name)
        _clip.check_source("geneval_detector", self.clip_model_name, self.clip_pretrained)


class GenevalDetector:
    """Scores ``outputs["images"]`` `[N, 3, H, W]` against the GenEval clauses of ``batch.metadata``."""

    Config = GenevalDetectorConfig
    modalities = frozenset({"image"})
    group_stage = None  # each score depends on its sample only (see mmgrpo.protocols.RewardFn)
    artifacts = frozenset()  # adds nothing for the sample writers

    modalities_for = classmethod(fixed_modalities)  # see mmgrpo.protocols.RewardFn
    artifacts_for = classmethod(fixed_artifacts)

    def __init__(self, config: GenevalDetectorConfig | None = None):
        from transformers import AutoModelForZeroShotObjectDetection, AutoProcessor

        self.config = cfg = config or GenevalDetectorConfig()
        location = resolve_pretrained(cfg.detector, "geneval_detector.detector")
        try:
            self.processor = AutoProcessor.from_pretrained(location)
            self.detector = AutoModelForZeroShotObjectDetection.from_pretrained(location, use_safetensors=True)
        except (OSError, ValueError) as err:
            raise RuntimeError(
                f"geneval_detector: could not load the detector from {cfg.detector!r} ({err}). Without network "
                f"access, download google/owlv2-base-patch16-ensemble (config, safetensors weights, processor files) "
                f"and set geneval_detector.detector to that folder."
            ) from err
        self.clip, self.tokenizer = _clip.load_open_clip("geneval_detector", cfg.clip_model_name,
                                                         cfg.clip_pretrained, cfg.device)
        self.device = next(self.clip.parameters()).device
        self.detector = self.detector.to(self.device).eval().requires_grad_(False)
        self.queries = [cfg.query_template.format(name=name) for name in OBJECT_NAMES]
        self._colour_classifiers: dict[str, torch.Tensor] = {}

    @torch.no_grad()
    def detect(self, pixels: torch.Tensor) -> list[list[tuple[str, tuple, float]]]:
        """Detections ``(class, [x0, y0, x1, y1] in pixels, confidence)`` of each image of `pixels` `[M, 3, H, W]` in
        [0, 1] above the lower of the two thresholds. Images reach the processor as 8-bit arrays, so its own resize,
        padding and normalisation apply."""
        from transformers import Owlv2ImageProcessor

        cfg = self.config
        h, w = pixels.shape[-2:]
        squared = isinstance(self.processor.image_processor, Owlv2ImageProcessor)
        size = (max(h, w), max(h, w)) if squared else (h, w)  # OWLv2 pads to a square before resizing
        found = []
        for i in range(0, pixels.shape[0], cfg.batch_size):
            chunk = (pixels[i : i + cfg.batch_size] * 255).round().clamp(0, 255).to(torch.uint8)  # [B, 3, H, W]
            arrays = list(chunk.permute(0, 2, 3, 1).numpy())  # B x [H, W, 3]
            inputs = self.processor(text=[self.queries] * len(arrays), images=arrays, return_tensors="pt")
            out = self.detector(**inputs.to(self.device))
            results = self.processor.post_process_grounded_object_detection(
                out, threshold=min(cfg.threshold, cfg.counting_threshold), target_sizes=[size] * len(arrays))
            for result in results:
                found.append([(OBJECT_NAMES[int(label)], tuple(float(v) for v in box), float(score))
                              for score, label, box in zip(result["scores"], result["labels"], result["boxes"])])
        return found

    def _classifier(self, name: str) -> torch.Tensor:
        """GenEval's zero-shot colour classifier of a class: `[D, 10]` averaged normalised template embeddings."""
        if name not in self._colour_classifiers:
            texts = [t.format(c=c, name=name) for c in COLORS for t in COLOR_TEMPLATES]
            embeddings = _clip.text_embeddings(texts, self.clip, self.tokenizer, 64)  # [10 * T, D]
            mean = embeddings.view(len(COLORS), len(COLOR_TEMPLATES), -1).mean(dim=1)  # [10, D]
            self._colour_classifiers[name] = F.normalize(mean, dim=-1).T
        return self._colour_classifiers[name]

    def colours(self, image: torch.Tensor, name: str, boxes: list[tuple]) -> list[str]:
        """The colour GenEval's CLIP classifier gives each box crop of `image` `[3, H, W]` in [0, 1]."""
        h, w = image.shape[-2:]
        crops = []
        for x0, y0, x1, y1 in boxes:
            left, top = min(max(round(x0), 0), w - 1), min(max(round(y0), 0), h - 1)
            right, bottom = max(min(round(x1), w), left + 1), max(min(round(y1), h), top + 1)
            crops.append(_clip.preprocess(image[None, :, top:bottom, left:right], self.clip))  # [1, 3, S, S]
        with torch.no_grad():
            features = F.normalize(self.clip.encode_image(torch.cat(crops)).float(), dim=-1).cpu()  # [K, D]
        return [COLORS[int(k)] for k in (features @ self._classifier(name)).argmax(dim=1)]

    def __call__(self, outputs: dict[str, Any], batch: PromptBatch) -> RewardResult:
        """Returns `scores` `[N]` (`score`: partial or strict) and `components` ``strict`` and ``partial``; NaN where
        the metadata holds no GenEval clauses this rule reads (or names a class outside GenEval's 80)."""
        cfg = self.config
        images, _ = frames(outputs, "image", "geneval_detector")  # [N, 3, H, W], non-finite values set to 0
        images = images.cpu().clamp(0, 1)
        usable = [i for i, m in enumerate(batch.metadata) if check_metadata(m) and all(
            c["class"] in OBJECT_NAMES for c in m["include"] + m.get("exclude", []))]
        strict, partial = nans(len(batch.metadata)), nans(len(batch.metadata))
        detections = self.detect(images[usable]) if usable else []
        for i, found in zip(usable, detections):
            metadata = batch.metadata[i]
            threshold = cfg.counting_threshold if metadata.get("tag") == "counting" else cfg.threshold
            per_class = {}
            for name, box, confidence in found:
                per_class.setdefault(name, []).append((box, confidence))
            kept = {name: select(d, threshold, cfg.max_objects, cfg.max_overlap) for name, d in per_class.items()}
            correct, passed, total = evaluate({k: v for k, v in kept.items() if v}, metadata,
                                              lambda name, boxes: self.colours(images[i], name, boxes),
                                              cfg.position_threshold)
            strict[i], partial[i] = float(correct), passed / total
        scores = partial if cfg.score == "partial" else strict
        return RewardResult(scores=scores.clone(), components={"strict": strict, "partial": partial})


PLUGIN = GenevalDetector
