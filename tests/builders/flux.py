"""Tiny FLUX pipeline (real diffusers / transformers classes, offline tokenizers) for tests."""

import pytest


@pytest.fixture(scope="session")
def tiny_flux_dir(tmp_path_factory):
    """A tiny random FLUX pipeline written with `save_pretrained`."""
    from mmgrpo.data.tiny_components import tiny_flux_pipeline

    path = tmp_path_factory.mktemp("tiny_flux")
    tiny_flux_pipeline(seed=0).save_pretrained(path)
    return str(path)


def build_policy(request):
    """A 3-step, 32 x 32 LoRA policy on `tiny_flux_dir`."""
    from mmgrpo.pipelines.flux import FluxConfig, FluxPolicy

    path = request.getfixturevalue("tiny_flux_dir")
    return FluxPolicy(FluxConfig(pretrained=path, resolution=32, num_steps=3, lora_rank=4, lora_alpha=8, max_sequence_length=16))
