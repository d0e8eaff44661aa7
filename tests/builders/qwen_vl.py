"""Tiny Qwen2-VL, Qwen2.5-VL, Qwen3-VL (dense and MoE) and Qwen3.5 (real transformers classes, offline tokenizer) and
their processors, for tests and the shipped base model (`scripts/train_vlm_shapes.py`)."""

from __future__ import annotations

import pytest

from ._tokenizers import QWEN_CHAT_TEMPLATE, QWEN_SPECIAL_TOKENS, qwen_tokenizer


@pytest.fixture(scope="session")
def tiny_qwen2_vl_dir(tmp_path_factory):
    """A tiny random Qwen2-VL and its processor, `save_pretrained`."""
    return save_tiny_qwen_vl(tmp_path_factory.mktemp("tiny_qwen2_vl"), "qwen2_vl")


@pytest.fixture(scope="session")
def tiny_qwen2_5_vl_dir(tmp_path_factory):
    """A tiny random Qwen2.5-VL and its processor, `save_pretrained`."""
    return save_tiny_qwen_vl(tmp_path_factory.mktemp("tiny_qwen2_5_vl"), "qwen2_5_vl")


@pytest.fixture(scope="session")
def tiny_qwen3_vl_dir(tmp_path_factory):
    """A tiny random Qwen3-VL (dense) and its processor, `save_pretrained`."""
    return save_tiny_qwen_vl(tmp_path_factory.mktemp("tiny_qwen3_vl"), "qwen3_vl")


@pytest.fixture(scope="session")
def tiny_qwen3_vl_moe_dir(tmp_path_factory):
    """A tiny random Qwen3-VL-MoE and its processor, `save_pretrained`."""
    return save_tiny_qwen_vl(tmp_path_factory.mktemp("tiny_qwen3_vl_moe"), "qwen3_vl_moe")


@pytest.fixture(scope="session")
def tiny_qwen3_5_dir(tmp_path_factory):
    """A tiny random Qwen3.5 (linear and full attention layers) and its processor, `save_pretrained`."""
    return save_tiny_qwen_vl(tmp_path_factory.mktemp("tiny_qwen3_5"), "qwen3_5")


@pytest.fixture(scope="session")
def tiny_qwen3_5_moe_dir(tmp_path_factory):
    """A tiny random Qwen3.5-MoE and its processor, `save_pretrained`."""
    return save_tiny_qwen_vl(tmp_path_factory.mktemp("tiny_qwen3_5_moe"), "qwen3_5_moe")


def build_policy(request):
    """A LoRA policy on `tiny_qwen2_vl_dir` writing 6 new tokens."""
    from mmgrpo.pipelines.qwen_vl import QwenVLConfig, QwenVLPolicy

    path = request.getfixturevalue("tiny_qwen2_vl_dir")
    return QwenVLPolicy(QwenVLConfig(pretrained=path, max_new_tokens=6, lora_rank=4, lora_alpha=8))


def tiny_qwen_vl(kind: str = "qwen2_vl", seed: int = 0, hidden_size: int = 64, num_layers: int = 2,
                 min_pixels: int = 56 * 56, max_pixels: int = 112 * 112, tokenizer=None):
    """A random tiny Qwen-VL of the real transformers class of `kind` and its processor.

    Args:
        kind (`str`, defaults to `"qwen2_vl"`): `"qwen2_vl"` (``Qwen2VLForConditionalGeneration``), `"qwen2_5_vl"`,
            `"qwen3_vl"`, `"qwen3_vl_moe"` (4 experts, 2 per token), `"qwen3_5"` (3 layers: linear, full and linear
            attention) or `"qwen3_5_moe"` (the same with 4 experts and a shared one). The Qwen3 families have 16-pixel
            patches (32-pixel resize cells), deepstack features (Qwen3-VL) and timestamped videos.
        seed (`int`, defaults to 0): seed of the weight initialisation.
        hidden_size (`int`, defaults to 64): width of the language model (and of the merged vision tokens).
        num_layers (`int`, defaults to 2): language-model layers.
        min_pixels, max_pixels (`int`): the image processor's pixel budget.
        tokenizer (*optional*): a Qwen tokenizer; defaults to `_tokenizers.qwen_tokenizer()`.

    Returns:
        `tuple`: ``(model, processor)``; the model is in `eval()` mode.
    """
    import torch
    import transformers as tf

    tok = tokenizer or qwen_tokenizer()
    ids = {name: tok.convert_tokens_to_ids(name) for name in QWEN_SPECIAL_TOKENS}
    heads = 4
    text = dict(
        vocab_size=len(tok), hidden_size=hidden_size, intermediate_size=2 * hidden_size, num_hidden_layers=num_layers,
        num_attention_heads=heads, num_key_value_heads=2, max_position_embeddings=2048,
        rope_parameters={"rope_type": "default", "rope_theta": 1e4, "mrope_section": _mrope(hidden_size // heads)},
        bos_token_id=None, eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"],
    )
    special = dict(
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
    )
    config, model_cls, proc_cls = _family(kind, text, special, hidden_size)
    patch = 16 if kind.startswith("qwen3") else 14
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    video_cls = tf.Qwen3VLVideoProcessor if kind.startswith("qwen3") else tf.Qwen2VLVideoProcessor
    processor = proc_cls(
        image_processor=tf.Qwen2VLImageProcessor(min_pixels=min_pixels, max_pixels=max_pixels, patch_size=patch,
                                                 merge_size=2),
        tokenizer=tok,
        video_processor=video_cls(size={"shortest_edge": min_pixels, "longest_edge": max_pixels}, patch_size=patch),
        chat_template=QWEN_CHAT_TEMPLATE,
    )
    return model, processor


def _family(kind: str, text: dict, special: dict, hidden_size: int):
    """The transformers config, model class and processor class of a tiny model of `kind`."""
    import transformers as tf

    if kind == "qwen2_vl":
        vision = dict(depth=2, embed_dim=32, hidden_size=hidden_size, num_heads=4, mlp_ratio=2, patch_size=14,
                      spatial_merge_size=2, temporal_patch_size=2)
        return (tf.Qwen2VLConfig(text_config=text, vision_config=vision, **special),
                tf.Qwen2VLForConditionalGeneration, tf.Qwen2VLProcessor)
    if kind == "qwen2_5_vl":
        vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=4, out_hidden_size=hidden_size,
                      patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=56,
                      fullatt_block_indexes=[1])
        return (tf.Qwen2_5_VLConfig(text_config=text, vision_config=vision, **special),
                tf.Qwen2_5_VLForConditionalGeneration, tf.Qwen2_5_VLProcessor)
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=4, out_hidden_size=hidden_size,
                  patch_size=16, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=64)
    text = {**text, "head_dim": hidden_size // 4}
    text["rope_parameters"] = {**text["rope_parameters"], "mrope_interleaved": True}
    if kind == "qwen3_vl":
        vision = {**vision, "deepstack_visual_indexes": [0]}
        return (tf.Qwen3VLConfig(text_config=text, vision_config=vision, **special),
                tf.Qwen3VLForConditionalGeneration, tf.Qwen3VLProcessor)
    if kind == "qwen3_vl_moe":
        text = {**text, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": hidden_size,
                "tie_word_embeddings": False}
        config = tf.Qwen3VLMoeConfig(text_config=text, vision_config={**vision, "deepstack_visual_indexes": [0]},
                                     **special)
        return config, tf.Qwen3VLMoeForConditionalGeneration, tf.Qwen3VLProcessor
    if kind in ("qwen3_5", "qwen3_5_moe"):
        rope = {**text["rope_parameters"], "partial_rotary_factor": 1.0}
        text = {**text, "rope_parameters": rope, "num_hidden_layers": 3,
                "layer_types": ["linear_attention", "full_attention", "linear_attention"],
                "linear_conv_kernel_dim": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
                "linear_num_key_heads": 2, "linear_num_value_heads": 4}
        if kind == "qwen3_5":
            return (tf.Qwen3_5Config(text_config=text, vision_config=vision, **special),
                    tf.Qwen3_5ForConditionalGeneration, tf.Qwen3VLProcessor)
        text = {**text, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": hidden_size,
                "shared_expert_intermediate_size": hidden_size}
        return (tf.Qwen3_5MoeConfig(text_config=text, vision_config=vision, **special),
                tf.Qwen3_5MoeForConditionalGeneration, tf.Qwen3VLProcessor)
    raise ValueError(f"kind must be one of qwen2_vl, qwen2_5_vl, qwen3_vl, qwen3_vl_moe, qwen3_5, qwen3_5_moe; got "
                     f"{kind!r}.")


def _mrope(head_dim: int) -> list[int]:
    """An M-RoPE section (temporal, height, width) summing to ``head_dim // 2``."""
    half = head_dim // 2
    t = half // 2
    h = (half - t) // 2
    return [t, h, half - t - h]


def save_tiny_qwen_vl(path: str, kind: str = "qwen2_vl", seed: int = 0, **kwargs) -> str:
    """Builds [`tiny_qwen_vl`] and writes model and processor to `path` with `save_pretrained`; returns the path."""
    model, processor = tiny_qwen_vl(kind, seed, **kwargs)
    model.save_pretrained(path)
    processor.save_pretrained(path)
    return str(path)
