"""Prompt inputs of the Qwen-VL adapter (`qwen_vl`): chat messages, pixel budgets, and one prompt through qwen-vl-utils
and the transformers processor.

**One resize under one budget.** qwen-vl-utils' ``process_vision_info`` resizes each image (each video frame) to a
multiple of patch x merge (28 pixels; 32 for the Qwen3 families' 16-pixel patches) within a pixel budget; the
processor would then resize again with the budget saved in its preprocessor config, so the model could see another
size than the one configured. Here each modality's budget is resolved once, at load: the configured ``min_pixels`` /
``max_pixels`` (``video_min_pixels`` / ``video_max_pixels`` per frame), an unset value taken from the processor's
saved ``size`` (``shortest_edge`` / ``longest_edge``). qwen-vl-utils resizes with it; the processor is called with
``do_resize=False`` (it only normalises and patchifies what it is given); and the processor's ``size`` is set to it,
so a checkpoint's saved processor resizes the same way elsewhere. The frame the model sees is ``image_grid_thw``'s h
and w times the patch size, which is what `record_input_size` writes.

The resized area lies in ``[min_pixels, max_pixels]`` except where rounding to the grid cannot: a budget
narrower than one grid step for the image's shape. For videos, qwen-vl-utils lowers the per-frame maximum further, to
768 tokens' worth (602112 pixels) and to an even share of its total-video budget (90% of 128k tokens), never below
``1.05 * min_pixels``. It floors a downscaled side to a multiple of the cell (of twice the cell for the frames of a
frame-list video)
without a lower bound: `PromptEncoder` refuses a budget below one such cell, and `encode` turns a side floored to 0
(a budget too small for an image's aspect ratio) into an error that names the key.

**Videos.** A frame list is played at ``video_fps`` (qwen-vl-utils' ``sample_fps``). The processor gets each video's
metadata from qwen-vl-utils (frame indices and fps) with ``do_sample_frames=False`` (the frames are already sampled):
Qwen2.5-VL spaces its temporal M-RoPE positions by it (``second_per_grid_ts`` = 2 / fps), and the Qwen3 families
write a ``<t seconds>`` timestamp before each merged frame (the mean time of its 2 frames).

Not a plugin: the name starts with an underscore and it defines no ``PLUGIN``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mmgrpo.types import as_list

VISION_OUTPUTS = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw", "second_per_grid_ts")


@dataclass(frozen=True)
class PixelBudget:
    """The pixel budget of one image (or one video frame): the resized area lies in ``[min_pixels, max_pixels]``."""

    min_pixels: int
    max_pixels: int


def resolve_budget(part, min_pixels: int | None, max_pixels: int | None, prefix: str, smallest: int) -> PixelBudget:
    """The budget of one modality: the configured values, an unset one taken from the processor part's saved ``size``;
    the part's ``size`` is then set to the budget (what ``save_pretrained`` writes).

    Args:
        part: the processor's ``image_processor`` or ``video_processor``.
        min_pixels (`int`, *optional*), max_pixels (`int`, *optional*): the configured values.
        prefix (`str`): ``""`` or ``"video_"``, to name the config keys in errors.
        smallest (`int`): the least usable ``max_pixels`` (one cell of qwen-vl-utils' resize grid).
    """
    from transformers.image_utils import SizeDict

    saved = part.size
    saved_min = saved.get("shortest_edge") if isinstance(saved, dict) else getattr(saved, "shortest_edge", None)
    saved_max = saved.get("longest_edge") if isinstance(saved, dict) else getattr(saved, "longest_edge", None)
    low = min_pixels if min_pixels is not None else saved_min
    high = max_pixels if max_pixels is not None else saved_max
    key_min, key_max = f"pipeline.{prefix}min_pixels", f"pipeline.{prefix}max_pixels"
    if low is None or high is None:
        raise ValueError(f"The processor saves no pixel budget ({saved}); set {key_min} and {key_max}.")
    if low > high:  # one of them is the processor's saved value (the Config refuses min > max)
        unset, fix = (key_max, f">= {low}") if max_pixels is None else (key_min, f"<= {high}")
        raise ValueError(
            f"{key_min}={low} is above {key_max}={high} ({unset} is unset: the processor's saved value); "
            f"set {unset} {fix}."
        )
    if high < smallest:
        raise ValueError(
            f"{key_max}={high} is below {smallest} pixels, the smallest area qwen-vl-utils can resize to (one "
            f"{int(smallest ** 0.5)} x {int(smallest ** 0.5)} cell of its grid); set {key_max} >= {smallest}."
        )
    part.size = SizeDict(shortest_edge=int(low), longest_edge=int(high))
    return PixelBudget(int(low), int(high))


class PromptEncoder:
    """Messages and model inputs of prompts, with one pixel budget per modality (see the module docstring).

    Args:
        processor: the model's transformers processor (its image and video processors' ``size`` are set here).
        config ([`QwenVLConfig`]): reads ``system_prompt``, ``video_fps`` and the pixel budgets.
    """

    def __init__(self, processor, config):
        from qwen_vl_utils.vision_process import SPATIAL_MERGE_SIZE

        self.processor, self.config = processor, config
        self.patch_size = processor.image_processor.patch_size
        merge = processor.image_processor.merge_size
        if merge != SPATIAL_MERGE_SIZE:
            raise ValueError(
                f"pipeline.pretrained {config.pretrained!r}: the processor merges {merge} x {merge} patches; "
                f"qwen-vl-utils resizes for {SPATIAL_MERGE_SIZE} x {SPATIAL_MERGE_SIZE} (every Qwen-VL family)."
            )
        cell = self.cell = self.patch_size * merge
        self.image_budget = resolve_budget(processor.image_processor, config.min_pixels, config.max_pixels, "", cell**2)
        # frames of a frame-list video are first resized on a grid twice as coarse (qwen-vl-utils' fetch_video)
        self.video_budget = resolve_budget(
            processor.video_processor, config.video_min_pixels, config.video_max_pixels, "video_", (2 * cell) ** 2
        )

    def messages(self, prompt: str, images: list, videos: list) -> list[dict]:
        """The chat messages of one prompt: optional system prompt, then the vision blocks (each with its modality's
        pixel budget) and the text."""
        c, image, video = self.config, self.image_budget, self.video_budget
        content = [{"type": "image", "image": x, "min_pixels": image.min_pixels, "max_pixels": image.max_pixels}
                   for x in images]
        content += [{"type": "video", "video": x, "fps": c.video_fps, "sample_fps": c.video_fps,
                     "min_pixels": video.min_pixels, "max_pixels": video.max_pixels} for x in videos]
        content.append({"type": "text", "text": prompt})
        system = [{"role": "system", "content": c.system_prompt}] if c.system_prompt else []
        return system + [{"role": "user", "content": content}]

    def _resize(self, messages: list[dict]) -> tuple:
        """qwen-vl-utils' ``process_vision_info`` of `messages` (the one resize): images, (video, metadata) pairs and
        the video kwargs; a side floored to 0 becomes an error that names the key."""
        from qwen_vl_utils import process_vision_info

        try:
            return process_vision_info(messages, return_video_kwargs=True, image_patch_size=self.patch_size,
                                       return_video_metadata=True)
        except ValueError as err:
            if "must be > 0" not in str(err):
                raise
            raise ValueError(
                f"qwen-vl-utils resized an image or video frame to zero pixels ({err}): its aspect ratio needs a "
                f"larger budget than pipeline.max_pixels={self.image_budget.max_pixels} / pipeline.video_max_pixels="
                f"{self.video_budget.max_pixels} (a side shorter than {self.cell} pixels after scaling, "
                f"{2 * self.cell} for the frames of a frame-list video, is floored to 0); raise that modality's "
                "max_pixels."
            ) from err

    def chat_text(self, messages: list[dict]) -> str:
        """The chat template's text of `messages`, ending in the assistant's turn (the generation prompt)."""
        return self.processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def encode(self, prompt: str, images: list, videos: list, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """One prompt through the chat template, ``process_vision_info`` (the one resize) and the processor (no
        resize): ``input_ids`` `[L]`, ``mm_token_type_ids`` `[L]` and the vision tensors (``pixel_values``
        `[patches, D]` in `dtype`, ``image_grid_thw`` `[images, 3]`, video counterparts, ``second_per_grid_ts``
        `[videos]`), on the CPU."""
        messages = self.messages(prompt, images, videos)
        text = self.chat_text(messages)
        image_inputs, video_inputs, video_kwargs = self._resize(messages)
        kwargs = dict(video_kwargs or {}) if video_inputs else {}
        if video_inputs:  # no resize happens here; set only to silence the processor's warning about the cap
            kwargs["cap_pixels_per_frame"] = True
        if video_inputs:  # (video, metadata) pairs: the metadata gives the frames' times (M-RoPE, timestamps)
            video_inputs, kwargs["video_metadata"] = [list(part) for part in zip(*video_inputs)]
        inputs = self.processor(text=[text], images=image_inputs, videos=video_inputs, do_resize=False,
                                return_tensors="pt", **kwargs)
        out = {"input_ids": inputs["input_ids"][0], "mm_token_type_ids": inputs["mm_token_type_ids"][0]}
        for key in VISION_OUTPUTS:
            if key in inputs:
                out[key] = torch.as_tensor(inputs[key])
        for key in ("pixel_values", "pixel_values_videos"):
            if key in out:
                out[key] = out[key].to(dtype)
        return out

    def encode_many(self, prompts: list[tuple[str, list, list]], dtype: torch.dtype) -> list[dict[str, torch.Tensor]]:
        """[`encode`] of each ``(prompt, images, videos)`` of `prompts`: the same tensors, with the prompts without
        videos sent to the processor in one call (its per-call work paid once), unpadded and split per prompt."""
        out: list[dict | None] = [None] * len(prompts)
        batched = [i for i, (_, _, videos) in enumerate(prompts) if not videos]
        for i in set(range(len(prompts))) - set(batched):
            out[i] = self.encode(*prompts[i], dtype)
        if not batched:
            return out
        texts, images, counts = [], [], []
        for i in batched:
            messages = self.messages(prompts[i][0], prompts[i][1], [])
            texts.append(self.chat_text(messages))
            resized = (self._resize(messages)[0] or []) if prompts[i][1] else []  # images resized once
            images += resized
            counts.append(len(resized))
        inputs = self.processor(text=texts, images=images or None, do_resize=False, padding=True, return_tensors="pt")
        grids = inputs.get("image_grid_thw")  # [images, 3]
        pixels = list(torch.as_tensor(inputs["pixel_values"]).split(grids.prod(dim=1).tolist())) if images else []
        starts = [sum(counts[:k]) for k in range(len(counts))]
        for k, i in enumerate(batched):
            kept = inputs["attention_mask"][k].bool()  # [L_padded] -> this prompt's tokens
            out[i] = {"input_ids": inputs["input_ids"][k][kept], "mm_token_type_ids": inputs["mm_token_type_ids"][k][kept]}
            if counts[k]:
                out[i]["pixel_values"] = torch.cat(pixels[starts[k] : starts[k] + counts[k]]).to(dtype)
                out[i]["image_grid_thw"] = grids[starts[k] : starts[k] + counts[k]]
        return out

    def record_input_size(self, metadata: dict, encoded: dict) -> None:
        """Writes ``input_size`` = ``[width, height]`` of the first image as the model saw it (``image_grid_thw`` w
        and h times the patch size) into the metadata of a prompt with an ``image_size``; a value the prompt source
        gave is replaced (boxes are answered in the frame the model saw)."""
        if "image_grid_thw" in encoded and "image_size" in metadata:
            _, h, w = encoded["image_grid_thw"][0].tolist()
            metadata["input_size"] = [w * self.patch_size, h * self.patch_size]


def vision_inputs(conditions: dict[str, list], i: int) -> tuple[list, list]:
    """Images and videos of prompt `i`: ``images`` (one or a list), ``video`` (one: a path or a frame list) and
    ``videos`` (a list of videos)."""
    images = as_list(conditions.get("images", [None] * (i + 1))[i])
    videos = as_list(conditions.get("videos", [None] * (i + 1))[i])
    if "video" in conditions and conditions["video"][i] is not None:
        videos.append(conditions["video"][i])
    unknown = set(conditions) - {"images", "video", "videos"}
    if unknown:
        raise ValueError(f"qwen_vl: unknown prompt conditions {sorted(unknown)}; use 'images', 'video' or 'videos'.")
    return images, videos
