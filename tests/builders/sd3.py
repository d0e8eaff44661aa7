"""Tiny SD3 pipeline (real diffusers / transformers classes) for tests."""

import pytest


@pytest.fixture(scope="session")
def tiny_sd3_dir(tmp_path_factory):
    """A tiny random SD3 pipeline written with `save_pretrained`."""
    from mmgrpo.data.tiny_components import tiny_sd3_pipeline

    path = tmp_path_factory.mktemp("tiny_sd3")
    tiny_sd3_pipeline(seed=0).save_pretrained(path)
    return str(path)


def build_policy(request):
    """A 3-step, 32 x 32 LoRA policy on `tiny_sd3_dir`."""
    from mmgrpo.pipelines.sd3 import SD3Config, SD3Policy

    path = request.getfixturevalue("tiny_sd3_dir")
    return SD3Policy(SD3Config(pretrained=path, resolution=32, num_steps=3, guidance_scale=1.0, lora_rank=4, max_sequence_length=16))
