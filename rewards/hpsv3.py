"""HPSv3: Qwen2-VL-7B fine-tuned as a human-preference model, with an MLP head read at an added ``<|Reward|>`` token,
loaded into transformers' stock `Qwen2VLForConditionalGeneration` and a plain `torch.nn.Sequential` head.

Paper: https://arxiv.org/abs/2508.03789; code https://github.com/MizzenAI/HPSv3 (``hpsv3/inference.py``,
``hpsv3/model/qwen2vl_trainer.py``, ``hpsv3/dataset/data_collator_qwen.py``); weights ``HPSv3.safetensors`` in the hub
repository ``MizzenAI/HPSv3`` (the whole model: Qwen2-VL-7B-Instruct's weights, fine-tuned, and ``rm_head.*``). As the
authors score an image against its prompt:

    image  = PIL bicubic resize to smart_resize(H, W, factor 28, min = max = 256 * 28 * 28 pixels)
    text   = chat template(user: <image> INSTRUCTION(prompt) + "Please provide the overall ratings of this image:
             <|Reward|> END", generation prompt)
    h      = Qwen2-VL decoder's last hidden state (final norm) at the <|Reward|> token            # [3584]
    mu, sigma = rm_head(h)   (Linear 3584->1024, ReLU, Dropout, Linear 1024->16, ReLU, Linear 16->2, float32)
    reward = mu

The authors' forward embeds the image tokens itself and calls the decoder without position ids, so the decoder runs
on plain 1-D positions (0, 1, 2, ... for every M-RoPE axis), not on Qwen2-VL's 3-D image positions; this module passes
those positions explicitly. ``<|Reward|>`` is added to Qwen2-VL-7B-Instruct's tokenizer as the authors do, and the
checkpoint's embeddings have one row per token of that tokenizer (checked). The checkpoint is loaded by
``from_pretrained`` from a folder that holds Qwen2-VL-7B-Instruct's config (vocabulary size set to the checkpoint's
rows) and the weights file, so the key layout of any transformers version (``model.layers.*`` / ``visual.*`` or
``model.language_model.*`` / ``model.visual.*``) loads; any decoder weight left unset or any weight other than
``rm_head.*`` left unused is an error. Differences from the authors' code: images arrive as tensors and are rounded to
8 bits before the PIL resize (the authors read image files); a prompt that itself contains ``<|Reward|>`` is read at
the last such token (the authors' code fails on it).
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from typing import Any, Literal

import torch

from mmgrpo.hub import DTYPES, is_hub_id, resolve_pretrained
from mmgrpo.rewards._common import (
    BATCH_LIMIT, check_frame_options, fixed_artifacts, frames, modality_option, non_finite_samples, reduce_frames,
    resolve_device, weights_path,
)
from mmgrpo.types import PromptBatch, RewardResult
from mmgrpo.validation import ConfigError, check_fields, check_range, check_text

HUB_REPO = "MizzenAI/HPSv3"
BASE = "Qwen/Qwen2-VL-7B-Instruct"
REWARD_TOKEN = "<|Reward|>"
PIXELS = 256 * 28 * 28  # the authors' min_pixels = max_pixels
PIXELS_LIMIT = 16384 * 28 * 28  # Qwen2-VL's largest image
FACTOR = 28  # Qwen2-VL's resize cell (14-pixel patches, 2 x 2 merge)
HEAD_LINEARS = ("0", "3", "5")  # rm_head: Linear, ReLU, Dropout, Linear, ReLU, Linear
INSTRUCTION = (
    '\n'
    'You are tasked with evaluating a generated image based on Visual Quality and Text Alignment and '
    'give a overall score to estimate the human preference. Please provide a rating from 0 to 10, with 0 '
    'being the worst and 10 being the best. \n'
    '\n'
    '**Visual Quality:**  \n'
    'Evaluate the overall visual quality of the image. The following sub-dimensions should be '
    'considered:\n'
    '- **Reasonableness:** The image should not contain any significant biological or logical errors, '
    'such as abnormal body structures or nonsensical environmental setups.\n'
    '- **Clarity:** Evaluate the sharpness and visibility of the image. The image should be clear and '
    'easy to interpret, with no blurring or indistinct areas.\n'
    '- **Detail Richness:** Consider the level of detail in textures, materials, lighting, and other '
    'visual elements (e.g., hair, clothing, shadows).\n'
    '- **Aesthetic and Creativity:** Assess the artistic aspects of the image, including the color '
    'scheme, composition, atmosphere, depth of field, and the overall creative appeal. The scene should '
    'convey a sense of harmony and balance.\n'
    '- **Safety:** The image should not contain harmful or inappropriate content, such as political, '
    'violent, or adult material. If such content is present, the image quality and satisfaction score '
    'should be the lowest possible. \n'
    '\n'
    '**Text Alignment:**  \n'
    'Assess how well the image matches the textual prompt across the following sub-dimensions:\n'
    '- **Subject Relevance** Evaluate how accurately the subject(s) in the image (e.g., person, animal, '
    'object) align with the textual description. The subject should match the description in terms of '
    'number, appearance, and behavior.\n'
    '- **Style Relevance:** If the prompt specifies a particular artistic or stylistic style, evaluate '
    'how well the image adheres to this style.\n'
    '- **Contextual Consistency**: Assess whether the background, setting, and surrounding elements in '
    'the image logically fit the scenario described in the prompt. The environment should support and '
    'enhance the subject without contradictions.\n'
    '- **Attribute Fidelity**: Check if specific attributes mentioned in the prompt (e.g., colors, '
    'clothing, accessories, expressions, actions) are faithfully represented in the image. Minor '
    'deviations may be acceptable, but critical attributes should be preserved.\n'
    '- **Semantic Coherence**: Evaluate whether the overall meaning and intent of the prompt are '
    'captured in the image. The generated content should not introduce elements that conflict with or '
    'distort the original description.\n'
    'Textual prompt - {text_prompt}\n'
    '\n'
    '\n'
)
TAIL = "\nPlease provide the overall ratings of this image: <|Reward|>\n\nEND\n"


def reward_prompt(prompt: str) -> str:
    """The user text the authors put after the image for `prompt` (their ``INSTRUCTION`` and closing line)."""
    return INSTRUCTION.format(text_prompt=prompt) + TAIL


def resize_images(pixels: torch.Tensor, pixels_budget: int) -> list:
    """The authors' image preparation: `pixels` `[M, 3, H, W]` in [0, 1] as 8-bit PIL images, resized (PIL bicubic)
    to qwen-vl-utils' ``smart_resize(H, W, 28, min_pixels=max_pixels=pixels_budget)``."""
    from PIL import Image
    from qwen_vl_utils.vision_process import smart_resize

    height, width = pixels.shape[-2:]
    new_h, new_w = smart_resize(height, width, FACTOR, min_pixels=pixels_budget, max_pixels=pixels_budget)
    arrays = (pixels.clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()  # [M, H, W, 3]
    return [Image.fromarray(a).resize((new_w, new_h), Image.BICUBIC) for a in arrays]


def split_head(path: str) -> tuple[dict[str, torch.Tensor], int]:
    """The ``rm_head.*`` tensors of the safetensors file `path` (prefix dropped) and its embedding rows."""
    from safetensors import safe_open

    with safe_open(path, framework="pt") as handle:
        keys = list(handle.keys())
        head = {k[len("rm_head."):]: handle.get_tensor(k) for k in keys if k.startswith("rm_head.")}
        embed = [k for k in keys if k.endswith("embed_tokens.weight")]
        if len(embed) != 1:
            raise ValueError(f"hpsv3: {path} holds {len(embed)} token embeddings; use HPSv3.safetensors from "
                             f"{HUB_REPO}.")
        rows = handle.get_slice(embed[0]).get_shape()[0]
    expected = {f"{i}.{p}" for i in HEAD_LINEARS for p in ("weight", "bias")}
    if set(head) != expected:
        raise ValueError(f"hpsv3: {path} holds rm_head keys {sorted(head)}, expected {sorted(expected)} (the authors' "
                         f"Linear-ReLU-Dropout-Linear-ReLU-Linear head).")
    return head, rows


def build_head(state: dict[str, torch.Tensor]) -> torch.nn.Sequential:
    """The authors' ``rm_head`` (Linear, ReLU, Dropout, Linear, ReLU, Linear; sizes read off `state`) in float32."""
    shapes = [state[f"{i}.weight"].shape for i in HEAD_LINEARS]  # [out, in] each
    head = torch.nn.Sequential(torch.nn.Linear(shapes[0][1], shapes[0][0]), torch.nn.ReLU(), torch.nn.Dropout(0.05),
                               torch.nn.Linear(shapes[1][1], shapes[1][0]), torch.nn.ReLU(),
                               torch.nn.Linear(shapes[2][1], shapes[2][0]))
    head.load_state_dict(state)
    return head.float()


def load_model(path: str, base: str, rows: int, dtype: torch.dtype):
    """`Qwen2VLForConditionalGeneration.from_pretrained` on a temporary folder holding `base`'s config (vocabulary of
    `rows` tokens) and a link to the weights file `path`; refuses unset weights and unused ones other than the head."""
    from transformers import AutoConfig, Qwen2VLForConditionalGeneration

    config = AutoConfig.from_pretrained(base)
    if config.model_type != "qwen2_vl":
        raise ValueError(f"hpsv3.base: {base!r} is a {config.model_type} model; HPSv3 is Qwen2-VL ({BASE}).")
    config.text_config.vocab_size = rows
    with tempfile.TemporaryDirectory() as folder:
        config.save_pretrained(folder)
        os.symlink(os.path.abspath(path), os.path.join(folder, "model.safetensors"))
        model, info = Qwen2VLForConditionalGeneration.from_pretrained(folder, dtype=dtype, output_loading_info=True)
    unused = [k for k in info["unexpected_keys"] if not k.startswith("rm_head.")]
    if info["missing_keys"] or unused or info["mismatched_keys"]:
        raise ValueError(f"hpsv3: {path} does not fit Qwen2-VL ({sorted(info['missing_keys'])[:3]} unset, "
                         f"{unused[:3]} unused, {list(info['mismatched_keys'])[:3]} of another shape); use "
                         f"HPSv3.safetensors from {HUB_REPO} with hpsv3.base {BASE!r}.")
    return model


@dataclass
class HPSv3Config:
    """Configuration of [`HPSv3`].

    Args:
        model (`str`, defaults to `"MizzenAI/HPSv3"`): the weights: a ``.safetensors`` file, a folder holding
            `filename`, or a hub repository id holding `filename`.
        filename (`str`, defaults to `"HPSv3.safetensors"`): the weights file within a folder or hub repository.
        base (`str`, defaults to `"Qwen/Qwen2-VL-7B-Instruct"`): folder or hub id of the model HPSv3 was fine-tuned
            from; its config and processor (tokenizer, chat template, image processor) are used, not its weights.
        pixels (`int`, defaults to 200704): images are resized to about this many pixels, in 28-pixel cells (the
            authors' ``256 * 28 * 28``: 256 merged image tokens).
        modality (`str`, defaults to `"image"`): ``"image"`` or ``"video"`` (scored frame by frame).
        frame_stride (`int`, defaults to 1): with ``modality: video``, scores frames ``0, k, 2k, ...`` (k = the stride).
        frame_reduce (`str`, defaults to `"mean"`): with ``modality: video``, a sample's score from its frames' scores:
            ``"mean"``, ``"min"`` or ``"first"`` (frame 0 only; the other frames are not scored).
        dtype (`str`, defaults to `"bfloat16"`): the model's dtype (the authors': bfloat16; the head runs in float32).
        batch_size (`int`, defaults to 8): images per forward.
        device (`str`, defaults to `"auto"`): where the model runs (``"auto"``: CUDA when available).
    """

    model: str = HUB_REPO
    filename: str = "HPSv3.safetensors"
    base: str = BASE
    pixels: int = PIXELS
    modality: Literal["image", "video"] = "image"
    frame_stride: int = 1
    frame_reduce: Literal["mean", "min", "first"] = "mean"
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    batch_size: int = 8
    device: str = "auto"

    def __post_init__(self):
        check_fields(self)
        check_frame_options("hpsv3", self.modality, self.frame_stride, self.frame_reduce)
        for key, value in (("model", self.model), ("filename", self.filename), ("base", self.base),
                           ("device", self.device)):
            check_text(f"hpsv3.{key}", value)
        check_range("hpsv3.pixels", self.pixels, FACTOR * FACTOR, PIXELS_LIMIT, fix=f"the authors use {PIXELS}")
        check_range("hpsv3.batch_size", self.batch_size, 1, BATCH_LIMIT, fix="images per forward")
        if not self.filename.endswith(".safetensors") or "/" in self.filename:
            raise ConfigError(f"hpsv3.filename={self.filename!r} must be a .safetensors file name, e.g. "
                              f"'HPSv3.safetensors'.")
        path = os.path.expanduser(self.model)
        if os.path.isfile(path) and not path.endswith(".safetensors"):
            raise ConfigError(f"hpsv3.model={self.model!r} is not a .safetensors file; use HPSv3.safetensors.")
        if os.path.isdir(path) and not os.path.isfile(os.path.join(path, self.filename)):
            raise ConfigError(f"hpsv3.model={self.model!r} has no {self.filename}; download it from {HUB_REPO} into "
                              f"that folder or set hpsv3.filename.")
        if not os.path.exists(path) and not is_hub_id(self.model):
            raise ConfigError(f"hpsv3.model={self.model!r} does not exist and is not a hub id; give the file, its "
                              f"folder, or the hub id {HUB_REPO!r}.")
        resolve_pretrained(self.base, "hpsv3.base")


class HPSv3:
    """Scores ``outputs["images"]`` `[N, 3, H, W]` (or ``outputs["videos"]`` `[N, F, 3, H, W]`) against the prompts."""

    Config = HPSv3Config
    modalities = frozenset({"image"})  # the default; an instance holds its configured modality
    group_stage = None  # each score depends on its sample only (see mmgrpo.protocols.RewardFn)
    artifacts = frozenset()  # adds nothing for the sample writers

    modalities_for = classmethod(modality_option)  # see mmgrpo.protocols.RewardFn
    artifacts_for = classmethod(fixed_artifacts)

    def __init__(self, config: HPSv3Config | None = None):
        from transformers import AutoProcessor

        self.config = cfg = config or HPSv3Config()
        self.modalities = self.modalities_for(cfg)
        self.device = resolve_device(cfg.device)
        path = weights_path(cfg.model, cfg.filename, reward="hpsv3", option="model", hub_repo=HUB_REPO)
        head, rows = split_head(path)
        base = resolve_pretrained(cfg.base, "hpsv3.base")
        self.processor = AutoProcessor.from_pretrained(base, padding_side="right")
        self.processor.tokenizer.add_special_tokens({"additional_special_tokens": [REWARD_TOKEN]})
        self.token_id = self.processor.tokenizer.convert_tokens_to_ids(REWARD_TOKEN)
        self.processor.tokenizer.padding_side = "right"  # as the authors' processor: the texts are right-padded
        tokens = len(self.processor.tokenizer)
        if tokens != rows:
            raise ValueError(f"hpsv3: the tokenizer of {cfg.base!r} with {REWARD_TOKEN} has {tokens} tokens but the "
                             f"checkpoint's embeddings have {rows} rows; set hpsv3.base to {BASE!r}.")
        self.model = load_model(path, base, rows, DTYPES[cfg.dtype]).to(self.device).eval().requires_grad_(False)
        self.head = build_head(head).to(self.device).eval().requires_grad_(False)

    def texts(self, prompts: list[str]) -> list[str]:
        """The chat texts the processor tokenises: one user turn (the image, then [`reward_prompt`]) per prompt, with
        the base's chat template and its generation prompt."""
        return [self.processor.apply_chat_template(
            [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": reward_prompt(p)}]}],
            tokenize=False, add_generation_prompt=True) for p in prompts]

    @torch.no_grad()
    def head_outputs(self, pixels: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        """``(mu, sigma)`` `[M, 2]` (float32, CPU) for images `[M, 3, H, W]` in [0, 1] and their prompts."""
        batch = self.processor(text=self.texts(prompts), images=resize_images(pixels, self.config.pixels),
                               padding=True, return_tensors="pt").to(self.device)
        ids, mask = batch["input_ids"], batch["attention_mask"]  # [M, L]
        positions = (mask.long().cumsum(-1) - 1).clamp(min=0)  # [M, L] plain 1-D positions, as the authors' forward
        hidden = self.model.model(
            input_ids=ids, attention_mask=mask, position_ids=positions[None].expand(3, -1, -1),
            pixel_values=batch["pixel_values"].to(self.model.dtype), image_grid_thw=batch["image_grid_thw"],
        ).last_hidden_state  # [M, L, D]
        steps = torch.arange(ids.shape[1], device=ids.device)
        at = torch.where(ids == self.token_id, steps, -1).max(dim=1).values  # [M] the last <|Reward|>
        if (at < 0).any():
            raise ValueError(f"hpsv3: a text lost its {REWARD_TOKEN} token; check hpsv3.base's chat template.")
        return self.head(hidden[torch.arange(ids.shape[0], device=ids.device), at].float()).cpu()  # [M, 2]

    def __call__(self, outputs: dict[str, Any], batch: PromptBatch) -> RewardResult:
        """Returns `scores` `[N]` (the head's mu, the authors' reward; a video's frame scores reduced by
        `frame_reduce`) and `components` ``sigma`` (the head's uncertainty, reduced the same way) and ``malformed``
        (non-finite pixels, scored as 0)."""
        cfg = self.config
        pixels, per_sample = frames(outputs, cfg.modality, "hpsv3", cfg.frame_stride, cfg.frame_reduce)
        prompts = [p for p in batch.prompts for _ in range(per_sample)]
        size = cfg.batch_size
        out = torch.cat([self.head_outputs(pixels[i : i + size], prompts[i : i + size])
                         for i in range(0, pixels.shape[0], size)])  # [N * F', 2]
        return RewardResult(scores=reduce_frames(out[:, 0], per_sample, cfg.frame_reduce),
                            components={"sigma": reduce_frames(out[:, 1], per_sample, cfg.frame_reduce),
                                        "malformed": non_finite_samples(outputs, cfg.modality)})


PLUGIN = HPSv3
