"""Changing a tiny policy's trained weights in tests, and a stand-in policy that holds trained weights only."""

import torch


def perturb(policy, seed: int, scale: float = 0.05) -> None:
    """Moves every trained weight by seeded Gaussian noise of std `scale` (LoRA's B starts at zero, so an untouched
    adapter would change nothing)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in policy.trainable_parameters():
            param.add_(scale * torch.randn(param.shape, generator=generator).to(param.dtype))


class Weights:
    """A policy as an algorithm's old model sees it: its trainable parameters only (one vector of 3 zeros)."""

    def __init__(self):
        self.params = [torch.nn.Parameter(torch.zeros(3))]

    def trainable_parameters(self):
        return self.params


def read_old(algorithm, policy: Weights) -> torch.Tensor:
    """The old model's weights `[3]` (`algorithm.old_policy`'s) as the trainer's next scoring sees them."""
    with algorithm.old_policy(policy):
        return policy.params[0].detach().clone()
