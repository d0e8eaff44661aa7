"""OCR reward (Flow-GRPO's text-rendering task): how closely the text an OCR model reads matches the prompt's quoted text.

Flow-GRPO (https://arxiv.org/abs/2505.05470, ``flow_grpo/ocr.py``) asks for text in double quotes (``a sign that says
"Open Late"``) and scores an image by the normalised edit distance of the text PaddleOCR reads to it:

    target = the prompt's text after its first ``"`` up to the next ``"`` (``prompt.split('"')[1]``)
    t, r   = target and the read text, with spaces removed and lowercased
    d      = 0 if t occurs in r, else min(Levenshtein(r, t), len(t))
    reward = 1 - d / len(t)                                             (in [0, 1])

The rule is the authors' (character-level Levenshtein with unit costs, spaces removed, lowercased, containment counts
as a match, the distance capped at the target's length). The OCR model differs: PaddleOCR is not a transformers
model, so this reads the text with a transformers `VisionEncoderDecoderModel` (TrOCR, default
``microsoft/trocr-base-printed``) and its processor, greedy decoding. TrOCR reads one line of text from the whole
image, so it reads small text in a busy scene less well than PaddleOCR's detector and recogniser; see docs/rewards.md.
A prompt without a quote, or with an empty quoted text, scores NaN (the authors' code raises an error there).

Cost bounds: both texts are cut to `max_chars` characters; the distance keeps two rows of the dynamic programme
(memory linear in the target's length) and is computed only when it can be below the cap (``|len(r) - len(t)| <
len(t)``), so one pair costs at most ``2 * max_chars ** 2`` cell updates.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch

from mmgrpo.hub import resolve_pretrained
from mmgrpo.rewards._common import (
    BATCH_LIMIT, check_frame_options, fixed_artifacts, frames, modality_option, nans, non_finite_samples,
    reduce_frames, resolve_device,
)
from mmgrpo.types import PromptBatch, RewardResult
from mmgrpo.validation import check_fields, check_range, check_text

MAX_CHARS_LIMIT = 4096  # characters of a target or a read text (Flow-GRPO's targets are under ~40)
NEW_TOKENS_LIMIT = 1024  # tokens the OCR model may generate per image


def quoted_text(prompt: str) -> str | None:
    """The text the prompt asks for: after its first ``"``, up to the next ``"`` or the end (as
    ``prompt.split('"')[1]``); None when the prompt has no ``"``."""
    start = prompt.find('"')
    if start < 0:
        return None
    end = prompt.find('"', start + 1)
    return prompt[start + 1 :] if end < 0 else prompt[start + 1 : end]


def edit_distance(a: str, b: str, cap: int) -> int:
    """``min(Levenshtein(a, b), cap)``: unit-cost insertions, deletions and substitutions of characters.

    Two rows of the dynamic programme over `b` (memory O(len(b))); returns `cap` at once when the length difference
    alone reaches it, and stops when a whole row is at or above it (the distance cannot fall below a row's minimum).
    """
    if abs(len(a) - len(b)) >= cap:
        return cap
    previous = list(range(len(b) + 1))  # distances of a[:0] to b[:j]
    for i, char in enumerate(a, start=1):
        current = [i] + [0] * len(b)
        for j, other in enumerate(b, start=1):
            current[j] = min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (char != other))
        if min(current) >= cap:
            return cap
        previous = current
    return min(previous[-1], cap)


def ocr_score(read: str, target: str, max_chars: int) -> float:
    """The authors' reward of a read text against the target (module docstring), both cut to `max_chars` first;
    NaN for an empty target."""
    read = read[:max_chars].replace(" ", "").lower()
    target = target[:max_chars].replace(" ", "").lower()
    if not target:
        return float("nan")
    distance = 0 if target in read else edit_distance(read, target, len(target))
    return 1.0 - distance / len(target)


@dataclass
class OcrConfig:
    """Configuration of [`Ocr`].

    Args:
        model (`str`, defaults to `"microsoft/trocr-base-printed"`): a local folder (``save_pretrained`` layout,
            safetensors weights) or hub id of a `VisionEncoderDecoderModel` OCR model with its processor.
        max_new_tokens (`int`, defaults to 64): tokens generated per image (greedy decoding).
        max_chars (`int`, defaults to 256): the target and the read text are cut to this many characters.
        modality (`str`, defaults to `"image"`): ``"image"`` or ``"video"`` (read frame by frame).
        frame_stride (`int`, defaults to 1): with ``modality: video``, reads frames ``0, k, 2k, ...`` (k = the stride).
        frame_reduce (`str`, defaults to `"mean"`): with ``modality: video``, a sample's score from its frames' scores:
            ``"mean"``, ``"min"`` or ``"first"`` (frame 0 only; the other frames are not read).
        batch_size (`int`, defaults to 16): images per generate call.
        device (`str`, defaults to `"auto"`): where the model runs (``"auto"``: CUDA when available).
    """

    model: str = "microsoft/trocr-base-printed"
    max_new_tokens: int = 64
    max_chars: int = 256
    modality: Literal["image", "video"] = "image"
    frame_stride: int = 1
    frame_reduce: Literal["mean", "min", "first"] = "mean"
    batch_size: int = 16
    device: str = "auto"

    def __post_init__(self):
        check_fields(self)
        check_frame_options("ocr", self.modality, self.frame_stride, self.frame_reduce)
        check_text("ocr.device", self.device)
        check_range("ocr.max_new_tokens", self.max_new_tokens, 1, NEW_TOKENS_LIMIT, fix="tokens read per image")
        check_range("ocr.max_chars", self.max_chars, 1, MAX_CHARS_LIMIT, fix="Flow-GRPO's targets are under ~40")
        check_range("ocr.batch_size", self.batch_size, 1, BATCH_LIMIT, fix="images per generate call")
        resolve_pretrained(self.model, "ocr.model")


class Ocr:
    """Scores ``outputs["images"]`` `[N, 3, H, W]` (or ``outputs["videos"]`` `[N, F, 3, H, W]`) by the quoted text."""

    Config = OcrConfig
    modalities = frozenset({"image"})  # the default; an instance holds its configured modality
    group_stage = None  # each score depends on its sample only (see mmgrpo.protocols.RewardFn)
    artifacts = frozenset()  # adds nothing for the sample writers

    modalities_for = classmethod(modality_option)  # see mmgrpo.protocols.RewardFn
    artifacts_for = classmethod(fixed_artifacts)

    def __init__(self, config: OcrConfig | None = None):
        from transformers import AutoProcessor, VisionEncoderDecoderModel

        self.config = config or OcrConfig()
        self.modalities = self.modalities_for(self.config)
        self.device = resolve_device(self.config.device)
        location = resolve_pretrained(self.config.model, "ocr.model")
        try:
            self.processor = AutoProcessor.from_pretrained(location)
            self.model = VisionEncoderDecoderModel.from_pretrained(location, use_safetensors=True).to(self.device)
        except (OSError, ValueError) as err:
            raise RuntimeError(
                f"ocr: could not load the OCR model or its processor from {self.config.model!r} ({err}). Without "
                f"network access, download microsoft/trocr-base-printed (config, safetensors weights, processor "
                f"files) and set ocr.model to that folder."
            ) from err
        self.model.eval().requires_grad_(False)

    @torch.no_grad()
    def read(self, pixels: torch.Tensor) -> list[str]:
        """The text the model reads in each image of `pixels` `[M, 3, H, W]` in [0, 1]. The images go to the
        processor as 8-bit arrays (as Flow-GRPO hands PaddleOCR its images), so the processor's own resize and
        normalisation apply."""
        texts = []
        for i in range(0, pixels.shape[0], self.config.batch_size):
            chunk = (pixels[i : i + self.config.batch_size] * 255).round().clamp(0, 255).to(torch.uint8)  # [B, 3, H, W]
            arrays = list(chunk.permute(0, 2, 3, 1).numpy())  # B x [H, W, 3]
            inputs = self.processor(images=arrays, return_tensors="pt").pixel_values.to(self.device)
            ids = self.model.generate(inputs, max_new_tokens=self.config.max_new_tokens, num_beams=1, do_sample=False)
            texts.extend(self.processor.batch_decode(ids, skip_special_tokens=True))
        return texts

    def __call__(self, outputs: dict[str, Any], batch: PromptBatch) -> RewardResult:
        """Returns `scores` `[N]` (NaN where the prompt quotes no text; a video's frame scores reduced by
        `frame_reduce`) and `components` ``exact`` (1 where the quoted text occurs in what was read, after the
        normalisation; reduced likewise) and ``malformed`` (non-finite pixels, read as 0)."""
        cfg = self.config
        targets = [quoted_text(p) for p in batch.prompts]
        pixels, per_sample = frames(outputs, cfg.modality, "ocr", cfg.frame_stride, cfg.frame_reduce)
        wanted = [i for i, t in enumerate(targets) if t is not None and t.replace(" ", "")]
        scores, exact = nans(len(targets)), nans(len(targets))
        if wanted:
            index = torch.tensor([i * per_sample + f for i in wanted for f in range(per_sample)])
            read = self.read(pixels[index])  # one text per frame of the wanted samples
            pairs = [(read[k], targets[wanted[k // per_sample]]) for k in range(len(read))]
            per_frame = torch.tensor([ocr_score(r, t, cfg.max_chars) for r, t in pairs])  # [W * F']
            hits = (per_frame == 1.0).float()  # [W * F'] distance 0: the target occurs in the read text
            scores[wanted] = reduce_frames(per_frame, per_sample, cfg.frame_reduce)
            exact[wanted] = reduce_frames(hits, per_sample, cfg.frame_reduce)
        return RewardResult(scores=scores, components={"exact": exact,
                                                       "malformed": non_finite_samples(outputs, cfg.modality)})


PLUGIN = Ocr
