"""The options of the `qwen_vl` pipeline, [`QwenVLConfig`], and their checks (types, token and pixel budgets within
the model's positions, sampling truncation, LoRA, attention backend), run before any weight loads; and the model
families it takes ([`FAMILIES`]: transformers class, box frame).

Not a plugin: `mmgrpo.pipelines.qwen_vl` holds the policy and exposes this `Config` as ``QwenVLPolicy.Config``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Literal

from mmgrpo.hub import resolve_pretrained
from mmgrpo.model_limits import (
    PIXELS_LIMIT, TOKEN_LIMIT, VOCAB_LIMIT, check_limit, check_lora, check_temperature, find_int, hidden_size,
    max_positions, read_json,
)
from mmgrpo.pipelines._qwen_vl_compile import COMPILED_FAMILIES
from mmgrpo.pipelines._qwen_vl_decode import LEAN_ATTENTION
from mmgrpo.validation import ConfigError, check_fields, check_range



@dataclass(frozen=True)
class Family:
    """What the adapter needs to know of one Qwen-VL family (keyed by the checkpoint's ``model_type``).

    Args:
        model_class (`str`): the transformers class.
        box_frame (`str`): the frame the model writes boxes and points in, as `rewards/box_iou.py` names them:
            ``"resized"`` (pixels of the resized model input: Qwen2.5-VL) or ``"norm1000"`` (0-1000 relative to the
            image: Qwen2-VL, Qwen3-VL, Qwen3.5).
    """

    model_class: str
    box_frame: Literal["resized", "norm1000"]


FAMILIES = {
    "qwen2_vl": Family("Qwen2VLForConditionalGeneration", "norm1000"),
    "qwen2_5_vl": Family("Qwen2_5_VLForConditionalGeneration", "resized"),
    "qwen3_vl": Family("Qwen3VLForConditionalGeneration", "norm1000"),
    "qwen3_vl_moe": Family("Qwen3VLMoeForConditionalGeneration", "norm1000"),
    "qwen3_5": Family("Qwen3_5ForConditionalGeneration", "norm1000"),
    "qwen3_5_moe": Family("Qwen3_5MoeForConditionalGeneration", "norm1000"),
}
# transformers' attention backends (besides hub kernels "org/name")
ATTENTION = ("sdpa", "eager", "flash_attention_2", "flash_attention_3", "flash_attention_4", "flex_attention",
             "paged|eager")


@dataclass
class QwenVLConfig:
    """Options of [`QwenVLPolicy`].

    Args:
        pretrained (`str`): a transformers folder (model + processor, as ``save_pretrained`` writes them), a hub id
            (``Qwen/Qwen2.5-VL-3B-Instruct``) or ``mmgrpo:<name>`` for a shipped toy model.
        max_new_tokens (`int`): completion tokens per training rollout (the policy's ``num_steps``).
        eval_max_new_tokens (`int`, *optional*): completion tokens at evaluation (default: `max_new_tokens`).
        temperature (`float`): sampling temperature; also the temperature of the scored policy.
        top_p (`float`), top_k (`int`): nucleus / top-k truncation of sampling only (1.0 / 0 disable them).
        system_prompt (`str`, *optional*): a system message put before every prompt.
        min_pixels (`int`, *optional*), max_pixels (`int`, *optional*): per-image pixel budget: each image is resized
            once to a multiple of patch x merge pixels (28 for Qwen2-VL / Qwen2.5-VL, 32 for Qwen3-VL / Qwen3.5) with
            an area in ``[min_pixels, max_pixels]``; unset: the processor's saved value. At least one cell (784 or
            1024).
        video_fps (`float`): frames per second of video inputs given as frame lists (temporal M-RoPE spacing for
            Qwen2.5-VL, the frames' timestamps for Qwen3-VL / Qwen3.5).
        video_min_pixels (`int`, *optional*), video_max_pixels (`int`, *optional*): per-frame pixel budget, likewise
            (``video_max_pixels`` at least 3136, 4096 for the Qwen3 families: qwen-vl-utils first resizes frame lists on
            a grid twice as coarse).
        lora_rank (`int`): LoRA rank on the language model; 0 trains the whole language model (and the vision
            tower unless `freeze_vision`), with a frozen copy as the reference.
        lora_alpha (`int`), lora_dropout (`float`): LoRA scaling numerator and dropout.
        lora_targets (`list[str]`): names of the language-model linear layers that get LoRA.
        freeze_vision (`bool`): keep the vision tower (and its merger) frozen; with LoRA, ``False`` also puts LoRA
            on the vision blocks.
        prefix_sharing (`bool`): in the training forward, run each group's prompt and images once and expand its KV
            cache to the group; ``False`` forwards every sample whole (the naive reference: same values, G times the
            prompt and vision cost). Sampling always shares the prompt's cache (it is the same for every member).
        weights_dtype (`str`): dtype of the frozen base under LoRA; trainable parameters are always float32, and a
            fully fine-tuned model runs in float32.
        attn_implementation (`str`): transformers attention backend (``"sdpa"``, ``"eager"``, ``"flash_attention_2"``).
        gradient_checkpointing (`bool`): recompute each decoder layer (and vision block) in the backward pass (same
            gradients, activations of one layer at a time, about one more forward per backward). It needs
            ``prefix_sharing: false``: a checkpointed layer cannot fill the KV cache the group forward shares.
        compile_decode (`bool`): run each decode step of sampling (embedding, decoder layers, norm, LM head) under
            ``torch.compile`` (see `_qwen_vl_compile.py`): the first rollout compiles it (seconds to a minute on a
            CPU), and a second batch shape once more. The families of full-attention layers (Qwen2-VL, Qwen2.5-VL,
            Qwen3-VL, Qwen3-VL-MoE; not Qwen3.5) with ``attn_implementation`` ``"sdpa"`` or ``"eager"``; a sharded
            model (``train.sharding``) decodes eagerly. The same tokens for the same generator as eager decoding
            (unless a draw falls on a float32 rounding tie), log-probs equal to about 1e-6.
        share_prompt_forward (`bool`): sampling forwards the prompts with gradients and hands that forward to the
            first update, which then forwards only the completions: one prompt and vision forward less per step (see
            `_qwen_vl_shared_prompt.py`). Its graph is held from sampling to that update (the training forward's
            prompt activations, during decoding). One process (no ``torchrun``), ``prefix_sharing: true``, the
            families of full-attention layers (not Qwen3.5). With ``train.mixed_precision`` the shared prompt forward
            runs under the run's autocast, in sampling too. With ``train.sample_chunks`` > 1 only the last chunk's
            forward is kept, which the first update then rarely matches; ``train.async`` samples without gradients,
            so nothing is kept.
    """

    pretrained: str
    max_new_tokens: int = 256
    eval_max_new_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    system_prompt: str | None = None
    min_pixels: int | None = None
    max_pixels: int | None = None
    video_fps: float = 2.0
    video_min_pixels: int | None = None
    video_max_pixels: int | None = None
    lora_rank: int = 64
    lora_alpha: int = 128
    lora_dropout: float = 0.0
    lora_targets: list[str] = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )
    freeze_vision: bool = True
    prefix_sharing: bool = True
    weights_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    attn_implementation: str = "sdpa"
    gradient_checkpointing: bool = False
    compile_decode: bool = False
    share_prompt_forward: bool = False

    @property
    def num_steps(self) -> int:
        """Decisions per training rollout: completion tokens (what `Algorithm.schedule` receives)."""
        return self.max_new_tokens

    def output_size(self) -> tuple[int, str]:
        """Bytes one sample's rollout record holds at least (token ids, log-probs, mask per completion token), and the
        key that sets them: the memory check of [`~mmgrpo.preflight.preflight`] reads it."""
        return self.max_new_tokens * (8 + 4 + 1), "pipeline.max_new_tokens"

    def __post_init__(self):
        check_fields(self)  # types and finiteness of every field
        model = read_json(resolve_pretrained(self.pretrained, "pipeline.pretrained"))  # {} when not readable here
        positions = max_positions(model)
        for key, tokens in (("max_new_tokens", self.max_new_tokens), ("eval_max_new_tokens", self.eval_max_new_tokens)):
            if tokens is not None:
                check_limit(key, tokens, 1, positions, TOKEN_LIMIT, "max_position_embeddings",
                            fix="or leave it unset (max_new_tokens)" if key.startswith("eval") else "")
        check_temperature("temperature", self.temperature)  # evaluation decodes greedily
        check_range("top_p", self.top_p, 0, 1, low_open=True, fix="1 disables nucleus truncation")
        check_limit("top_k", self.top_k, 0, find_int(model, "vocab_size"), VOCAB_LIMIT, "the vocabulary size",
                    fix="0 disables top-k truncation")
        cell = vision_cell(model)
        bounds = (("", cell, self.min_pixels, self.max_pixels),
                  ("video_", 2 * cell, self.video_min_pixels, self.video_max_pixels))
        for prefix, grid, low, high in bounds:  # qwen-vl-utils' resize grid (frame lists: twice as coarse first)
            # one image's tokens (a token per cell) must fit in the model's positions
            most = positions * cell**2 if positions else PIXELS_LIMIT
            if low is not None:
                check_range(f"{prefix}min_pixels", low, 1, most, fix="or leave it unset (the processor's saved value)")
            if high is not None:
                check_range(f"{prefix}max_pixels", high, grid**2, most,
                            fix=f"qwen-vl-utils resizes to {grid}-pixel cells, and one image's tokens (one per "
                            f"{cell} x {cell} pixels) fit in the model's positions")
            if low is not None and high is not None:
                check_range(f"{prefix}min_pixels", low, high=high, fix=f"lower it or raise {prefix}max_pixels")
        check_range("video_fps", self.video_fps, 0.01, 1000, fix="the frame rate of frame-list videos, e.g. 2.0")
        check_lora(self, hidden_size(model))
        check_range("lora_dropout", self.lora_dropout, 0, 1, high_open=True, fix="e.g. 0.05, or 0 for none")
        if not self.lora_targets or not all(self.lora_targets):
            raise ConfigError(f"lora_targets must be a non-empty list of layer names (e.g. ['q_proj', 'v_proj']), "
                              f"got {self.lora_targets!r}.")
        if self.attn_implementation not in ATTENTION and "/" not in self.attn_implementation:
            raise ConfigError(f"attn_implementation must be one of {list(ATTENTION)} or a hub kernel ('org/name'), "
                              f"got {self.attn_implementation!r}.")
        if self.gradient_checkpointing and self.prefix_sharing:
            raise ConfigError("gradient_checkpointing needs prefix_sharing: false (a checkpointed layer runs without "
                              "the KV cache that the prefix-shared group forward expands): set "
                              "pipeline.prefix_sharing: false, or gradient_checkpointing: false.")
        if self.compile_decode:
            check_compile_decode(model.get("model_type"), self.attn_implementation)
        if self.share_prompt_forward:
            check_share_prompt_forward(model.get("model_type"), self.prefix_sharing,
                                       int(os.environ.get("WORLD_SIZE", "1")))


def check_share_prompt_forward(model_type: str | None, prefix_sharing: bool, world: int) -> None:
    """Refuses ``share_prompt_forward`` where the first update cannot continue from sampling's prompt forward: the
    naive training forward, a hybrid family (its recurrent states are overwritten in place by decoding), or a run
    over several processes (`world`, torchrun's ``WORLD_SIZE``: the distributed wrapper's forward must run)."""
    if not prefix_sharing:
        raise ConfigError("share_prompt_forward needs prefix_sharing: true (the naive training forward has no prompt "
                          "forward to share): set pipeline.share_prompt_forward: false.")
    require_full_attention("share_prompt_forward", model_type)
    if world > 1:
        raise ConfigError(f"share_prompt_forward runs in one process; this launch has {world} (WORLD_SIZE): set "
                          "pipeline.share_prompt_forward: false.")


def require_full_attention(option: str, model_type: str | None) -> None:
    """Refuses `option` for a family with other than full-attention layers (`model_type` None: the checkpoint's config
    is not readable here, checked when the model loads)."""
    if model_type is not None and model_type not in COMPILED_FAMILIES:
        raise ConfigError(f"{option} takes the families of full-attention layers {list(COMPILED_FAMILIES)}; "
                          f"the model is a {model_type!r}: set pipeline.{option}: false.")


def check_compile_decode(model_type: str | None, attn_implementation: str) -> None:
    """Refuses ``compile_decode`` for a family or an attention backend whose decode step does not compile to one graph
    (`model_type` None: the checkpoint's config is not readable here, checked when the model loads)."""
    require_full_attention("compile_decode", model_type)
    if attn_implementation not in LEAN_ATTENTION:
        raise ConfigError(f"compile_decode needs attn_implementation in {list(LEAN_ATTENTION)} (the lean decode loop's "
                          f"4-D masks), got {attn_implementation!r}: change it, or set compile_decode: false.")


def vision_cell(model: dict) -> int:
    """The side in pixels of one merged vision token of a checkpoint's config (patch size x spatial merge: 28 for
    Qwen2-VL / Qwen2.5-VL, 32 for Qwen3-VL / Qwen3.5); 28 when the config is not readable here."""
    vision = model.get("vision_config") if isinstance(model.get("vision_config"), dict) else {}
    patch, merge = vision.get("patch_size", 14), vision.get("spatial_merge_size", 2)
    return patch * merge if isinstance(patch, int) and isinstance(merge, int) else 28
