"""Tiny FLUX.1 Kontext pipeline for tests: the components of [`builders.flux.tiny_flux_pipeline`] in a
`FluxKontextPipeline` (the same classes), which reloads with plain `FluxKontextPipeline.from_pretrained`."""

from __future__ import annotations

import pytest
import torch

from .flux import tiny_flux_pipeline


@pytest.fixture(scope="session")
def tiny_flux_kontext_dir(tmp_path_factory):
    """A tiny random FLUX.1 Kontext pipeline written with `save_pretrained`."""
    from diffusers import FluxKontextPipeline

    path = tmp_path_factory.mktemp("tiny_flux_kontext")
    FluxKontextPipeline(**tiny_flux_pipeline(seed=0).components).save_pretrained(path)
    return str(path)


def input_images(count: int, size: int = 32, seed: int = 0) -> list[torch.Tensor]:
    """`count` random input images `[3, size, size]` in [0, 1] (what an edit prompt's ``conditions["images"]``
    holds)."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.rand(3, size, size, generator=generator) for _ in range(count)]


def build_policy(request):
    """A 3-step, 32 x 32 LoRA policy on `tiny_flux_kontext_dir`."""
    from mmgrpo.pipelines.flux_kontext import FluxKontextConfig, FluxKontextPolicy

    path = request.getfixturevalue("tiny_flux_kontext_dir")
    return FluxKontextPolicy(FluxKontextConfig(pretrained=path, resolution=32, num_steps=3, lora_rank=4, lora_alpha=8,
                                               max_sequence_length=16))
