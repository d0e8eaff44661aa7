"""Tiny Qwen-Image-Edit pipeline for tests: the components of [`builders.qwen_image.tiny_qwen_image_pipeline`] with a
tokenizer that also learnt the edit template and the tiny Qwen2.5-VL's processor, in a `QwenImageEditPipeline` (or
`QwenImageEditPlusPipeline`), which reloads with plain `from_pretrained`."""

from __future__ import annotations

import pytest

# the system prompt of QwenImageEditPipeline's template, learnt by the tiny tokenizer so the prompts stay short
EDIT_TEMPLATE_TEXT = ("Describe the key features of the input image (color, shape, size, texture, objects, background), "
                      "then explain how the user's text instruction should alter or modify the image. Generate a new "
                      "image that meets the user's requirements while maintaining consistency with the original input "
                      "where appropriate.")
CONDITION_AREA = 32 * 32  # the tiny policies' input image size


def tiny_qwen_image_edit_pipeline(seed: int = 0, plus: bool = False):
    """A randomly initialised, tiny `QwenImageEditPipeline` (`QwenImageEditPlusPipeline` with `plus`; see
    `builders/qwen_image.py` for the sizes)."""
    from diffusers import QwenImageEditPipeline, QwenImageEditPlusPipeline

    from ._tokenizers import qwen_tokenizer
    from .qwen_image import TEMPLATE_TEXT, tiny_qwen_image_pipeline
    from .qwen_vl import tiny_qwen_vl

    base = tiny_qwen_image_pipeline(seed=seed)
    tokenizer = qwen_tokenizer(extra_words=[TEMPLATE_TEXT, EDIT_TEMPLATE_TEXT] * 4)
    text_encoder, processor = tiny_qwen_vl("qwen2_5_vl", seed=seed, hidden_size=64, tokenizer=tokenizer)
    components = {**base.components, "text_encoder": text_encoder.eval(), "tokenizer": tokenizer,
                  "processor": processor}
    return (QwenImageEditPlusPipeline if plus else QwenImageEditPipeline)(**components)


@pytest.fixture(scope="session")
def tiny_qwen_image_edit_dir(tmp_path_factory):
    """A tiny random Qwen-Image-Edit pipeline written with `save_pretrained`."""
    path = tmp_path_factory.mktemp("tiny_qwen_image_edit")
    tiny_qwen_image_edit_pipeline(seed=0).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def tiny_qwen_image_edit_plus_dir(tmp_path_factory):
    """A tiny random Qwen-Image-Edit-Plus pipeline (the same weights) written with `save_pretrained`."""
    path = tmp_path_factory.mktemp("tiny_qwen_image_edit_plus")
    tiny_qwen_image_edit_pipeline(seed=0, plus=True).save_pretrained(path)
    return str(path)


def build_policy(request):
    """A 3-step, 32 x 32 LoRA policy on `tiny_qwen_image_edit_dir` with true CFG 2 and a 32 x 32 input image."""
    from mmgrpo.pipelines.qwen_image_edit import QwenImageEditConfig, QwenImageEditPolicy

    path = request.getfixturevalue("tiny_qwen_image_edit_dir")
    return QwenImageEditPolicy(QwenImageEditConfig(
        pretrained=path, resolution=32, num_steps=3, true_cfg_scale=2.0, lora_rank=4, lora_alpha=8,
        max_sequence_length=32, weights_dtype="float32", condition_area=CONDITION_AREA,
    ))
