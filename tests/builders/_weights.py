"""Changing a tiny policy's trained weights in tests."""

import torch


def perturb(policy, seed: int, scale: float = 0.05) -> None:
    """Moves every trained weight by seeded Gaussian noise of std `scale` (LoRA's B starts at zero, so an untouched
    adapter would change nothing)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in policy.trainable_parameters():
            param.add_(scale * torch.randn(param.shape, generator=generator).to(param.dtype))
