"""ImageReward: BLIP (ViT-L image encoder, BERT text encoder with cross-attention) and an MLP head, trained on human
preference rankings, loaded into transformers' stock `BlipVisionModel` and `BlipTextModel`.

Paper: https://arxiv.org/abs/2304.05977; code https://github.com/THUDM/ImageReward (``ImageReward/ImageReward.py``);
weights ``ImageReward.pt`` and ``med_config.json`` in the hub repository ``THUDM/ImageReward``. As the authors score:

    e      = visual_encoder(image)                                    # [T, 1024] patch tokens, final LayerNorm
    h      = text_encoder(prompt tokens, cross-attending to e)[0]      # the [CLS] token's last hidden state, [768]
    reward = (mlp(h) - 0.16717362830052426) / 1.0333394966054072

The MLP is LAION's aesthetic head layout (768 -> 1024 -> 128 -> 64 -> 16 -> 1, no activations). Prompts are tokenised
with BERT's uncased WordPiece, padded to 35 tokens and truncated there; images are resized (shorter side 224, bicubic),
centre-cropped and normalised with OpenAI CLIP's mean and std. The checkpoint's keys are the authors' BLIP code's; this
module renames the image encoder's (``blip.visual_encoder.blocks.N.attn.qkv`` -> ``encoder.layers.N.self_attn.qkv``
...) and keeps the text encoder's (the same BERT layout), and refuses a checkpoint that leaves any weight of the two
models unset or any of its encoder weights unused. Differences from the authors' code: images are resized on tensors
(theirs through PIL), the authors' two added tokens (``[DEC]``, ``[ENC]``) are not added to the tokenizer (they never
occur in a prompt's tokens), and the weights are read without pickle code (``torch.load(weights_only=True)``).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

import torch

from mmgrpo.hub import is_hub_id, resolve_pretrained
from mmgrpo.rewards._clip import resize_crop_normalize
from mmgrpo.rewards._common import (
    BATCH_LIMIT, fixed_artifacts, fixed_modalities, frames, non_finite_samples, resolve_device,
)
from mmgrpo.rewards.aesthetic import laion_head
from mmgrpo.types import PromptBatch, RewardResult
from mmgrpo.validation import ConfigError, check_fields, check_range, check_text

HUB_REPO = "THUDM/ImageReward"
MEAN, STD = 0.16717362830052426, 1.0333394966054072  # the authors' normalisation of the head's output
CLIP_MEAN, CLIP_STD = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)
MAX_LENGTH = 35  # prompt tokens, as the authors pad and truncate
HEAD_DIM = 64  # BLIP's ViTs (B: 768 / 12 heads, L: 1024 / 16 heads)
_VISION_BLOCK = (("norm1.", "layer_norm1."), ("attn.qkv.", "self_attn.qkv."), ("attn.proj.", "self_attn.projection."),
                 ("norm2.", "layer_norm2."), ("mlp.fc1.", "mlp.fc1."), ("mlp.fc2.", "mlp.fc2."))
_VISION_TOP = {"cls_token": "embeddings.class_embedding", "pos_embed": "embeddings.position_embedding",
               "patch_embed.proj.weight": "embeddings.patch_embedding.weight",
               "patch_embed.proj.bias": "embeddings.patch_embedding.bias",
               "norm.weight": "post_layernorm.weight", "norm.bias": "post_layernorm.bias"}


def vision_key(suffix: str) -> str | None:
    """A ``blip.visual_encoder.`` key's suffix as `BlipVisionModel` names it (None: no counterpart)."""
    if suffix in _VISION_TOP:
        return _VISION_TOP[suffix]
    parts = suffix.split(".", 2)
    if parts[0] == "blocks" and len(parts) == 3:
        for old, new in _VISION_BLOCK:
            if parts[2].startswith(old):
                return f"encoder.layers.{parts[1]}.{new}{parts[2][len(old):]}"
    return None


def split_checkpoint(state: dict[str, torch.Tensor]) -> tuple[dict, dict, dict]:
    """The authors' state dict as ``(vision, text, head)`` state dicts of `BlipVisionModel`, `BlipTextModel` and the
    MLP. Raises `ValueError` naming an image-encoder key with no counterpart."""
    vision, text, head = {}, {}, {}
    for key, value in state.items():
        if key.startswith("blip.visual_encoder."):
            new = vision_key(key[len("blip.visual_encoder."):])
            if new is None:
                raise ValueError(f"image_reward: the checkpoint's {key} has no counterpart in BlipVisionModel.")
            vision[new] = value
        elif key.startswith("blip.text_encoder.") and not key.endswith("position_ids"):
            text[key[len("blip.text_encoder."):]] = value
        elif key.startswith("mlp.layers."):
            head[key[len("mlp.layers."):]] = value
    return vision, text, head


def model_configs(vision: dict, med_config: dict):
    """`BlipVisionConfig` read off the image encoder's weights (width, depth, patch and image size; 64-wide heads as
    BLIP's ViTs) and `BlipTextConfig` from the authors' ``med_config.json`` (BERT with cross-attention)."""
    from transformers import BlipTextConfig, BlipVisionConfig

    width = vision["embeddings.class_embedding"].shape[-1]
    patch = vision["embeddings.patch_embedding.weight"].shape[-1]
    tokens = vision["embeddings.position_embedding"].shape[1] - 1
    depth = len({k.split(".")[2] for k in vision if k.startswith("encoder.layers.")})
    vision_config = BlipVisionConfig(
        hidden_size=width, intermediate_size=vision["encoder.layers.0.mlp.fc1.weight"].shape[0], num_hidden_layers=depth,
        num_attention_heads=max(1, width // HEAD_DIM), image_size=round(tokens ** 0.5) * patch, patch_size=patch,
        layer_norm_eps=1e-6, hidden_act="gelu",
    )
    keys = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "max_position_embeddings", "hidden_act", "layer_norm_eps", "pad_token_id")
    text_config = BlipTextConfig(**{k: med_config[k] for k in keys if k in med_config}, encoder_hidden_size=width,
                                 is_decoder=True)  # is_decoder builds the cross-attention layers (not a causal mask)
    return vision_config, text_config


def model_files(location: str) -> tuple[str, str]:
    """Local paths of ``ImageReward.pt`` and ``med_config.json``: in the folder `location`, or from the hub repository
    `location` (the local cache when offline)."""
    folder = os.path.expanduser(location)
    if os.path.isdir(folder):
        return os.path.join(folder, "ImageReward.pt"), os.path.join(folder, "med_config.json")
    from huggingface_hub import hf_hub_download

    try:
        return hf_hub_download(location, "ImageReward.pt"), hf_hub_download(location, "med_config.json")
    except Exception as err:  # offline, missing file, no such repository
        raise RuntimeError(
            f"image_reward: could not get ImageReward.pt and med_config.json from {location!r} ({err}). Download both "
            f"from https://huggingface.co/{HUB_REPO} into a folder and set image_reward.model to it."
        ) from err


@dataclass
class ImageRewardConfig:
    """Configuration of [`ImageReward`].

    Args:
        model (`str`, defaults to `"THUDM/ImageReward"`): a folder holding ``ImageReward.pt`` and ``med_config.json``,
            or the hub repository holding them.
        tokenizer (`str`, defaults to `"google-bert/bert-base-uncased"`): folder or hub id of BERT's uncased tokenizer.
        batch_size (`int`, defaults to 32): images per forward.
        device (`str`, defaults to `"auto"`): where the model runs (``"auto"``: CUDA when available).
    """

    model: str = HUB_REPO
    tokenizer: str = "google-bert/bert-base-uncased"
    batch_size: int = 32
    device: str = "auto"

    def __post_init__(self):
        check_fields(self)
        check_text("image_reward.device", self.device)
        check_range("image_reward.batch_size", self.batch_size, 1, BATCH_LIMIT, fix="images per forward")
        folder = os.path.expanduser(self.model)
        if os.path.isdir(folder):
            missing = [f for f in ("ImageReward.pt", "med_config.json") if not os.path.isfile(os.path.join(folder, f))]
            if missing:
                raise ConfigError(f"image_reward.model={self.model!r} lacks {missing}; download them from {HUB_REPO}.")
        elif not is_hub_id(self.model):
            raise ConfigError(f"image_reward.model={self.model!r} is neither a folder nor a hub id; give the folder "
                              f"holding ImageReward.pt and med_config.json, or {HUB_REPO!r}.")
        resolve_pretrained(self.tokenizer, "image_reward.tokenizer")


class ImageReward:
    """Scores ``outputs["images"]`` `[N, 3, H, W]` against the prompts."""

    Config = ImageRewardConfig
    modalities = frozenset({"image"})
    group_stage = None  # each score depends on its sample only (see mmgrpo.protocols.RewardFn)
    artifacts = frozenset()  # adds nothing for the sample writers

    modalities_for = classmethod(fixed_modalities)  # see mmgrpo.protocols.RewardFn
    artifacts_for = classmethod(fixed_artifacts)

    def __init__(self, config: ImageRewardConfig | None = None):
        from transformers import AutoTokenizer, BlipTextModel, BlipVisionModel

        self.config = cfg = config or ImageRewardConfig()
        self.device = resolve_device(cfg.device)
        weights, med_config = model_files(cfg.model)
        try:
            state = torch.load(weights, map_location="cpu", weights_only=True)
        except Exception as err:  # a pickle that needs code to load, or not a torch file
            raise ValueError(f"image_reward: {weights} does not load as plain tensors ({err}).") from err
        vision, text, head = split_checkpoint(state)
        with open(med_config, encoding="utf-8") as handle:
            vision_config, text_config = model_configs(vision, json.load(handle))
        self.vision = BlipVisionModel(vision_config)
        self.text = BlipTextModel(text_config, add_pooling_layer=False)
        self.head = laion_head(text_config.hidden_size)
        for name, module, part in (("image encoder", self.vision, vision), ("text encoder", self.text, text),
                                   ("head", self.head, head)):
            result = module.load_state_dict(part, strict=False)
            unset = [k for k in result.missing_keys if not k.endswith("position_ids")]
            if unset or result.unexpected_keys:
                raise ValueError(f"image_reward: the checkpoint's {name} does not fit ({unset[:3]} unset, "
                                 f"{result.unexpected_keys[:3]} unused); use ImageReward.pt from {HUB_REPO}.")
        for module in (self.vision, self.text, self.head):
            module.to(self.device).eval().requires_grad_(False)
        self.tokenizer = AutoTokenizer.from_pretrained(resolve_pretrained(cfg.tokenizer, "image_reward.tokenizer"))
        self.size = vision_config.image_size

    @torch.no_grad()
    def raw_scores(self, pixels: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        """The head's output `[M]` (before the authors' normalisation) for images `[M, 3, H, W]` in [0, 1]."""
        images = resize_crop_normalize(pixels, self.size, CLIP_MEAN, CLIP_STD, self.device)  # [M, 3, S, S]
        embeds = self.vision(pixel_values=images).last_hidden_state  # [M, T, D_v]
        text = self.tokenizer(prompts, padding="max_length", truncation=True, max_length=MAX_LENGTH,
                              return_tensors="pt").to(self.device)
        hidden = self.text(input_ids=text.input_ids, attention_mask=text.attention_mask, encoder_hidden_states=embeds,
                           encoder_attention_mask=torch.ones(embeds.shape[:-1], dtype=torch.long, device=self.device),
                           ).last_hidden_state  # [M, L, D_t]
        return self.head(hidden[:, 0].float()).squeeze(-1).cpu()  # [M]

    def __call__(self, outputs: dict[str, Any], batch: PromptBatch) -> RewardResult:
        """Returns `scores` `[N]` (the authors' normalised reward) and `components` ``raw`` (the head's output) and
        ``malformed`` (non-finite pixels, scored as 0)."""
        pixels, _ = frames(outputs, "image", "image_reward")
        size = self.config.batch_size
        raw = torch.cat([self.raw_scores(pixels[i : i + size], list(batch.prompts[i : i + size]))
                         for i in range(0, pixels.shape[0], size)]).float()  # [N]
        return RewardResult(scores=(raw - MEAN) / STD,
                            components={"raw": raw, "malformed": non_finite_samples(outputs, "image")})


PLUGIN = ImageReward
