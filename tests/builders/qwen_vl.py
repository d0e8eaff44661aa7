"""Tiny Qwen2-VL and Qwen2.5-VL (real transformers classes, offline tokenizer) and their processors, for tests and the
shipped base model (`scripts/train_vlm_shapes.py`)."""

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


def build_policy(request):
    """A LoRA policy on `tiny_qwen2_vl_dir` writing 6 new tokens."""
    from mmgrpo.pipelines.qwen_vl import QwenVLConfig, QwenVLPolicy

    path = request.getfixturevalue("tiny_qwen2_vl_dir")
    return QwenVLPolicy(QwenVLConfig(pretrained=path, max_new_tokens=6, lora_rank=4, lora_alpha=8))


def tiny_qwen_vl(kind: str = "qwen2_vl", seed: int = 0, hidden_size: int = 64, num_layers: int = 2,
                 min_pixels: int = 56 * 56, max_pixels: int = 112 * 112, tokenizer=None):
    """A random tiny ``Qwen2VLForConditionalGeneration`` (``kind="qwen2_vl"``) or
    ``Qwen2_5_VLForConditionalGeneration`` (``"qwen2_5_vl"``) and its processor.

    Args:
        kind (`str`, defaults to `"qwen2_vl"`): `"qwen2_vl"` or `"qwen2_5_vl"`.
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
    if kind == "qwen2_vl":
        vision = dict(depth=2, embed_dim=32, hidden_size=hidden_size, num_heads=4, mlp_ratio=2, patch_size=14,
                      spatial_merge_size=2, temporal_patch_size=2)
        config = tf.Qwen2VLConfig(text_config=text, vision_config=vision, **special)
        model_cls, proc_cls = tf.Qwen2VLForConditionalGeneration, tf.Qwen2VLProcessor
    elif kind == "qwen2_5_vl":
        vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=4, out_hidden_size=hidden_size,
                      patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=56, fullatt_block_indexes=[1])
        config = tf.Qwen2_5_VLConfig(text_config=text, vision_config=vision, **special)
        model_cls, proc_cls = tf.Qwen2_5_VLForConditionalGeneration, tf.Qwen2_5_VLProcessor
    else:
        raise ValueError(f"kind must be 'qwen2_vl' or 'qwen2_5_vl', got {kind!r}.")
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    processor = proc_cls(
        image_processor=tf.Qwen2VLImageProcessor(min_pixels=min_pixels, max_pixels=max_pixels, patch_size=14, merge_size=2),
        tokenizer=tok,
        video_processor=tf.Qwen2VLVideoProcessor(min_pixels=min_pixels, max_pixels=max_pixels),
        chat_template=QWEN_CHAT_TEMPLATE,
    )
    return model, processor


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
