"""Tiny Qwen2-VL and Qwen2.5-VL (real transformers classes, offline tokenizer) and their processors for tests."""

import pytest


@pytest.fixture(scope="session")
def tiny_qwen2_vl_dir(tmp_path_factory):
    """A tiny random Qwen2-VL and its processor, `save_pretrained`."""
    from mmgrpo.data.tiny_vlm import save_tiny_qwen_vl

    return save_tiny_qwen_vl(tmp_path_factory.mktemp("tiny_qwen2_vl"), "qwen2_vl")


@pytest.fixture(scope="session")
def tiny_qwen2_5_vl_dir(tmp_path_factory):
    """A tiny random Qwen2.5-VL and its processor, `save_pretrained`."""
    from mmgrpo.data.tiny_vlm import save_tiny_qwen_vl

    return save_tiny_qwen_vl(tmp_path_factory.mktemp("tiny_qwen2_5_vl"), "qwen2_5_vl")


def build_policy(request):
    """A LoRA policy on `tiny_qwen2_vl_dir` writing 6 new tokens."""
    from mmgrpo.pipelines.qwen_vl import QwenVLConfig, QwenVLPolicy

    path = request.getfixturevalue("tiny_qwen2_vl_dir")
    return QwenVLPolicy(QwenVLConfig(pretrained=path, max_new_tokens=6, lora_rank=4, lora_alpha=8))
