"""Segmenter reward: a frozen SAM 2 turns the boxes and points a VLM writes into a mask, scored against the truth.

The recipe of Seg-Zero (https://arxiv.org/abs/2503.06520) and Seg-R1 (https://arxiv.org/abs/2506.22624): the policy is a
plain text VLM (`qwen_vl`); its answer (parsed as `mmgrpo.rewards._seg_parse` describes, ``answer_format`` ``seg_zero``
or ``seg_r1``, coordinates mapped from the model's frame as in `box_iou`) prompts SAM 2, each box with its points (masks
of several boxes are united), and the mask is scored:

    score = (1 - w) * IoU(M, T) + w * S(M, T),    IoU = |M & T| / |M | T|  (1 when both are empty)

with `w` = `s_measure_weight` (Seg-R1: 0.3; S the structure measure of `s_measure`). An answer with no usable box
predicts an empty mask (IoU 0 against a non-empty truth) and raises its counters.

**Why SAM lives in a reward.** Rewards already run in their own process and on their own GPU through ``mmgrpo
serve-reward`` (Seg-R1 gives SAM its own GPU), any mask metric composes with ``composite`` (format, box terms), and the
policy stays a `qwen_vl` text policy with its tested replay and prefix sharing; a segmentation stage inside the
pipeline would put a second model in every policy process and a new output modality through every algorithm.

**One image embedding per group.** The `G` completions of a prompt share its image: SAM's image encoder runs once per
distinct image of a batch (samples are keyed by the image's path, else by their global group id, else by the image
object), in one batched call; prompt encoding and mask decoding run batched over every (sample, box) pair, each pair indexing its
image's embedding; low-resolution masks are up-sampled to the original image with the processor's
``post_process_masks``.

Inputs: ``outputs["texts"]``; the image from ``batch.conditions[image_key]``, else ``metadata[image_key]`` (a path, PIL
image or tensor `[3, H, W]` in [0, 1]; the first of a list); the truth ``metadata[gt_key]`` (a tensor `[H, W]` or any
encoding of `mmgrpo.rewards._seg_masks.load_mask`); ``image_size`` / ``input_size`` as in `box_iou` (``image_size`` is
read from the image when absent). A sample without truth is not applicable (NaN). Components (each `[N]`): ``iou`` (its
mean over an evaluation is the gIoU), ``intersection`` and ``union`` (pixels; ``mean(intersection) / mean(union)`` is
the cIoU), ``s_measure``, ``num_boxes``, ``truncated`` and the parser's 0/1 counters. With `attach_masks`, the result's
artifacts (declared by ``artifacts_for``) hold the predicted masks, ``"mask"`` (bool `[H, W]`, original pixels; `None`
for a sample without truth), and the parsed prompts, ``"seg_prompts"``, which the text sample writer draws as overlays
(see `mmgrpo._mask_overlays`; in the process that scored only: a remote reward returns scores and components).
Not checked: whether the reasoning in ``<think>`` is sound (add the ``format`` or ``seg_zero`` reward for layout).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F

from mmgrpo.hub import DTYPES, resolve_pretrained
from mmgrpo.rewards._common import (
    BATCH_LIMIT, MAX_COMPLETION_CHARS, check_max_completion_chars, cut_texts, fixed_modalities, nans, resolve_device,
    texts,
)
from mmgrpo.rewards._seg_masks import intersection_union, load_mask
from mmgrpo.rewards._seg_parse import COUNTERS, FORMATS, SegPrompt, parse_prompt
from mmgrpo.rewards.box_iou import BoxIoU
from mmgrpo.rewards.mask_iou import s_measure
from mmgrpo.types import PromptBatch, RewardResult, as_list
from mmgrpo.validation import ConfigError, check_fields, check_range, check_text

PAD = -10  # the SAM 2 processor's padding value for points and labels


@dataclass
class SamMaskConfig:
    """Configuration of [`SamMask`].

    Args:
        model (`str`): a SAM 2 / 2.1 folder written by ``save_pretrained`` (model + processor) or a hub id
            (``facebook/sam2.1-hiera-large``); SAM v1, whose processor normalises prompts against its padded resize,
            is refused.
        processor (`str`, *optional*): where the processor is, when not beside the model.
        answer_format (`str`, defaults to `"seg_zero"`): ``"seg_zero"`` or ``"seg_r1"`` (see the module docstring).
        coords (`str`, defaults to `"model"`): the frame of the model's numbers, as in `box_iou` (``"model"``: the
            frame the pipeline declares in ``metadata["coords"]``; or a fixed frame).
        s_measure_weight (`float`, defaults to 0.0): ``w`` in the score (Seg-R1: 0.3).
        gt_key (`str`, defaults to `"mask"`), image_key (`str`, defaults to `"images"`): truth and image keys.
        mask_threshold (`float`, defaults to 0.0): logits above it are foreground.
        multimask_output (`bool`, defaults to `False`): SAM's three candidates, keeping the best-scored one.
        device (`str`, defaults to `"auto"`): where SAM runs (``"auto"``: CUDA when available).
        dtype (`str`, defaults to `"float32"`): ``float32``, ``bfloat16`` or ``float16``.
        max_boxes (`int`, defaults to 16), max_points (`int`, defaults to 32): read from one answer at most.
        max_completion_chars (`int`, *optional*, defaults to 16384): the text length cap (component ``truncated``).
        decode_batch (`int`, defaults to 64): (sample, box) pairs per mask-decoder call.
        attach_masks (`bool`, defaults to `True`): add the artifacts ``mask`` and ``seg_prompts`` to each result, for
            the sample writers' overlays.
    """

    model: str
    processor: str | None = None
    answer_format: Literal["seg_zero", "seg_r1"] = "seg_zero"
    coords: Literal["resized", "original", "norm1000", "norm1", "model"] = "model"
    s_measure_weight: float = 0.0
    gt_key: str = "mask"
    image_key: str = "images"
    mask_threshold: float = 0.0
    multimask_output: bool = False
    device: str = "auto"
    dtype: str = "float32"
    max_boxes: int = 16
    max_points: int = 32
    max_completion_chars: int | None = MAX_COMPLETION_CHARS
    decode_batch: int = 64
    attach_masks: bool = True

    def __post_init__(self):
        check_fields(self)
        for key, value in {"model": self.model, "gt_key": self.gt_key, "image_key": self.image_key,
                           "device": self.device}.items():
            check_text(key, value)
        check_range("s_measure_weight", self.s_measure_weight, 0, 1, fix="0 for IoU only, 0.3 as Seg-R1")
        check_range("max_boxes", self.max_boxes, 1, 1024, fix="e.g. 16")
        check_range("max_points", self.max_points, 0, 1024, fix="e.g. 32")
        check_range("decode_batch", self.decode_batch, 1, BATCH_LIMIT, fix="e.g. 64")
        check_range("mask_threshold", self.mask_threshold, -100, 100, fix="a mask logit; 0 is SAM's own threshold")
        check_max_completion_chars(self.max_completion_chars)
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}.")
        if self.answer_format not in FORMATS:  # (check_fields checks the Literal; kept for a direct reader)
            raise ConfigError(f"answer_format must be one of {list(FORMATS)}, got {self.answer_format!r}.")
        resolve_pretrained(self.model, "reward.model")  # a missing folder fails here, before any model loads
        if self.processor is not None:
            resolve_pretrained(self.processor, "reward.processor")


class SamMask:
    """Scores ``outputs["texts"]`` by the IoU (and S-measure) of the masks SAM 2 draws from them."""

    Config = SamMaskConfig
    modalities = frozenset({"text"})
    group_stage = None  # each score depends on its sample only (see mmgrpo.protocols.RewardFn)
    artifacts = frozenset({"mask", "seg_prompts"})  # the default (attach_masks); an instance holds its options'

    modalities_for = classmethod(fixed_modalities)  # see mmgrpo.protocols.RewardFn

    @classmethod
    def artifacts_for(cls, config: SamMaskConfig) -> frozenset[str]:
        """The predicted masks and parsed prompts (``mask``, ``seg_prompts``) with `attach_masks`, else none."""
        return frozenset({"mask", "seg_prompts"}) if config.attach_masks else frozenset()

    def __init__(self, config: SamMaskConfig):
        from transformers import AutoModel, AutoProcessor

        self.config = config
        self.artifacts = self.artifacts_for(config)
        self.device = resolve_device(config.device)
        self.dtype = DTYPES[config.dtype]
        location = resolve_pretrained(config.model, "reward.model")
        model = AutoModel.from_pretrained(location, dtype=self.dtype, use_safetensors=True)  # never a pickle
        self.model = model.to(self.device).eval().requires_grad_(False)
        if type(self.model).__name__ != "Sam2Model":
            raise ValueError(
                f"sam_mask: reward.model {config.model!r} is a {type(self.model).__name__}; it runs SAM 2 / 2.1 "
                "(transformers' Sam2Model with its Sam2Processor), e.g. facebook/sam2.1-hiera-large."
            )
        self.processor = AutoProcessor.from_pretrained(resolve_pretrained(config.processor or config.model))
        self.mapper = BoxIoU(BoxIoU.Config(coords=config.coords))

    # ------------------------------------------------------------------------------------------------ inputs
    def _image(self, batch: PromptBatch, i: int):
        from mmgrpo.visualize import as_pil

        image = as_pil(self._source(batch, i))
        if image is None:
            raise ValueError(
                f"sam_mask: sample {i} has ground truth but no readable image in batch.conditions"
                f"[{self.config.image_key!r}] or its metadata (a path, PIL image or [3, H, W] tensor); set "
                "reward.image_key or give the prompt source's images."
            )
        return image

    def _source(self, batch: PromptBatch, i: int):
        """The first image of sample `i`: ``batch.conditions[image_key]``, else ``metadata[image_key]``, else None."""
        key = self.config.image_key
        values = as_list(batch.conditions[key][i] if key in batch.conditions else batch.metadata[i].get(key))
        return values[0] if values else None

    def _key(self, batch: PromptBatch, i: int):
        """Samples with the same key share one image (and one SAM embedding): the image's path, else the global
        group (images decoded by a server are distinct objects), else the image object."""
        first = self._source(batch, i)
        if isinstance(first, str):
            return "path", first
        return ("group", int(batch.group_ids[i])) if batch.group_ids is not None else ("object", id(first))

    @torch.no_grad()
    def embed(self, images: list) -> Any:
        """SAM's image embeddings of `images` (PIL), one batched encoder call: a list of feature maps `[U, C, h, w]`
        (SAM 2) or one tensor `[U, C, h, w]` (SAM)."""
        pixels = self.processor(images=images, return_tensors="pt")["pixel_values"]  # [U, 3, S, S]
        return self.model.get_image_embeddings(pixels.to(self.device, self.dtype))

    # ------------------------------------------------------------------------------------------------ masks
    @torch.no_grad()
    def segment(self, embeddings, rows: list[tuple[int, list, list, list]], sizes: list[list[int]]) -> list:
        """Masks of prompt rows, batched: each row ``(image index, box, points, labels)`` (original pixels) -> a bool
        mask `[H, W]` at its image's size `sizes[image]` (``[H, W]``)."""
        masks = []
        for start in range(0, len(rows), self.config.decode_batch):
            chunk = rows[start : start + self.config.decode_batch]
            index = torch.tensor([r[0] for r in chunk], device=self.device)  # [R]
            originals = [sizes[r[0]] for r in chunk]
            width = max(1, max(len(r[2]) for r in chunk))
            points = [[[p for p in r[2]] + [[PAD, PAD]] * (width - len(r[2]))] for r in chunk]  # [R, 1, P, 2]
            labels = [[list(r[3]) + [PAD] * (width - len(r[3]))] for r in chunk]  # [R, 1, P]
            prompts = self.processor(original_sizes=originals, input_boxes=[[r[1]] for r in chunk],
                                     input_points=points, input_labels=labels, return_tensors="pt")
            selected = ([e[index] for e in embeddings] if isinstance(embeddings, (list, tuple))
                        else embeddings[index])
            out = self.model(image_embeddings=selected, input_boxes=prompts["input_boxes"].to(self.device, self.dtype),
                             input_points=prompts["input_points"].to(self.device, self.dtype),
                             input_labels=prompts["input_labels"].to(self.device),
                             multimask_output=self.config.multimask_output)
            logits = out.pred_masks.float()  # [R, 1, M, h, w]
            if self.config.multimask_output:  # the candidate SAM scores best
                best = out.iou_scores.float().argmax(dim=-1)  # [R, 1]
                logits = logits.gather(2, best[..., None, None, None].expand(-1, -1, 1, *logits.shape[-2:]))
            up = self.processor.post_process_masks(logits[:, :, :1].cpu(), originals,
                                                   mask_threshold=self.config.mask_threshold)
            masks.extend(m.reshape(-1, *m.shape[-2:])[0].bool() for m in up)  # [H, W] each
        return masks

    def predict(self, answers: list[str | None], batch: PromptBatch, todo: list[int]):
        """Prompts and predicted masks (bool `[H, W]`, original pixels) of the samples `todo`."""
        keys, images, slot = {}, [], []
        for i in todo:
            key = self._key(batch, i)
            if key not in keys:
                keys[key] = len(images)
                images.append(self._image(batch, i))
            slot.append(keys[key])
        sizes = [[image.height, image.width] for image in images]
        prompts, rows, owner = {}, [], []
        for i, u in zip(todo, slot):
            metadata = dict(batch.metadata[i])
            metadata.setdefault("image_size", [sizes[u][1], sizes[u][0]])
            c = self.config
            prompts[i] = parse_prompt(answers[i], c.answer_format, self.mapper, metadata, i, c.max_boxes, c.max_points)
            for box, points, labels in zip(prompts[i].boxes, prompts[i].points, prompts[i].labels):
                rows.append((u, box, points, labels))
                owner.append(i)
        masks = {i: torch.zeros(sizes[u], dtype=torch.bool) for i, u in zip(todo, slot)}
        if rows:
            embeddings = self.embed(images)
            for i, mask in zip(owner, self.segment(embeddings, rows, sizes)):
                masks[i] |= mask  # several boxes: the union
        return prompts, masks

    def __call__(self, outputs: dict[str, Any], batch: PromptBatch) -> RewardResult:
        """Returns `scores` `[N]`, the components of the module docstring, each `[N]`, and with `attach_masks` the
        artifacts ``mask`` and ``seg_prompts`` (`N` values each). `outputs` is only read."""
        n, c = len(batch), self.config
        answers, truncated = cut_texts(texts(outputs, n, "sam_mask"), c.max_completion_chars)
        todo = [i for i in range(n) if c.gt_key in batch.metadata[i]]
        names = ("score", "iou", "s_measure", "intersection", "union", "num_boxes", *COUNTERS)
        columns = {name: nans(n) for name in names}
        prompts, masks = self.predict(answers, batch, todo) if todo else ({}, {})
        for i in todo:
            truth = load_mask(batch.metadata[i][c.gt_key]).cpu()  # [H, W]
            pred = masks[i]
            if pred.shape != truth.shape:
                pred = F.interpolate(pred[None, None].float(), size=tuple(truth.shape), mode="nearest")[0, 0].bool()
            inter, union = intersection_union(pred, truth)
            iou = inter / union if union > 0 else 1.0
            structure = s_measure(pred.float(), truth)
            values = {"iou": iou, "s_measure": structure, "intersection": inter, "union": union,
                      "num_boxes": float(len(prompts[i].boxes)), **prompts[i].counters,
                      "score": (1 - c.s_measure_weight) * iou + c.s_measure_weight * structure}
            for name, value in values.items():
                columns[name][i] = value
        artifacts = {}  # kind -> N values, exactly the declared kinds (artifacts_for)
        if c.attach_masks:
            artifacts = {"mask": [masks.get(i) for i in range(n)],
                         "seg_prompts": [_as_dict(prompts.get(i)) for i in range(n)]}
        scores = columns.pop("score")
        return RewardResult(scores=scores, components={**columns, "truncated": truncated}, artifacts=artifacts)


def _as_dict(prompt: SegPrompt | None) -> dict | None:
    return None if prompt is None else {"boxes": prompt.boxes, "points": prompt.points, "labels": prompt.labels}


PLUGIN = SamMask
