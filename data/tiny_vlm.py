"""Tiny Qwen2-VL / Qwen2.5-VL models built offline from the real transformers classes, for tests and toy base models.

The tokenizer is a byte-level BPE trained in-process on a small corpus (deterministic), wrapped in
`Qwen2Tokenizer` with Qwen's special tokens and a ChatML chat template that renders image and video blocks as
Qwen does (``<|vision_start|><|image_pad|><|vision_end|>``). Not a plugin (no ``PLUGIN``).
"""

from __future__ import annotations

from typing import Iterable

SPECIAL_TOKENS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>",
    "<|image_pad|>", "<|video_pad|>",
]
# Qwen's chat template, reduced to what the adapter uses: system / user / assistant turns whose content is a string or
# a list of {"type": "text" | "image" | "video"} blocks.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}"
    "{% endfor %}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = (
    "You are a helpful assistant. How many red circles are in the image? What colour is the square? Give the box of "
    "the triangle. <think> I see two red circles and one blue square. </think> <answer> 2 </answer> "
    "<answer> [12, 30, 48, 60] </answer> red green blue yellow purple orange circle square triangle 0 1 2 3 4 5 6 7 8 9"
)


def qwen_tokenizer(corpus: str = CORPUS, vocab_size: int = 400, extra_words: Iterable[str] = ()):
    """A byte-level BPE `Qwen2Tokenizer` trained on `corpus` (deterministic), with Qwen's special tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import Qwen2Tokenizer

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=["<|endoftext|>"],
        show_progress=False,
    )
    bpe.train_from_iterator([corpus, *extra_words] * 4, trainer=trainer)
    model = bpe.get_vocab()
    import json

    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in json.loads(bpe.to_str())["model"]["merges"]]
    tok = Qwen2Tokenizer(vocab=model, merges=merges, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tok.add_special_tokens({"additional_special_tokens": SPECIAL_TOKENS[1:]})
    tok.chat_template = CHAT_TEMPLATE
    return tok


def tiny_qwen_vl(kind: str = "qwen2_vl", seed: int = 0, hidden_size: int = 64, num_layers: int = 2,
                 min_pixels: int = 56 * 56, max_pixels: int = 112 * 112, tokenizer=None):
    """A random tiny ``Qwen2VLForConditionalGeneration`` (``kind="qwen2_vl"``) or
    ``Qwen2_5_VLForConditionalGeneration`` (``"qwen2_5_vl"``) and its processor.

    Returns:
        `tuple`: ``(model, processor)``; the model is in `eval()` mode.
    """
    import torch
    import transformers as tf

    tok = tokenizer or qwen_tokenizer()
    ids = {name: tok.convert_tokens_to_ids(name) for name in SPECIAL_TOKENS}
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
        chat_template=CHAT_TEMPLATE,
    )
    return model, processor


def _mrope(head_dim: int) -> list[int]:
    """An M-RoPE section (temporal, height, width) summing to ``head_dim // 2``."""
    half = head_dim // 2
    t = half // 2
    h = (half - t) // 2
    return [t, h, half - t - h]


def save_tiny_qwen_vl(path: str, kind: str = "qwen2_vl", seed: int = 0, **kwargs) -> str:
    """Builds [`tiny_qwen_vl`] and writes model and processor to `path` with `save_pretrained`."""
    model, processor = tiny_qwen_vl(kind, seed, **kwargs)
    model.save_pretrained(path)
    processor.save_pretrained(path)
    return str(path)
