"""The one optimizer builder: AdamW (``train.optim``: torch's default implementation or the fused one) over the
policy's trainable parameters, linear warm-up, then a constant or cosine learning rate."""

from __future__ import annotations

import math

import torch

from .sections import TrainConfig


def learning_rate_factor(update: int, config: TrainConfig) -> float:
    """Multiplier of `config.learning_rate` at optimizer update `update` (0-based).

    Linear warm-up over `warmup_steps` updates, then constant, or a cosine from 1 to `min_lr_ratio` at the last of
    the ``max_steps * updates_per_step * inner_epochs`` updates.
    """
    warmup = config.warmup_steps
    if warmup and update < warmup:
        return (update + 1) / warmup
    if config.lr_schedule == "constant":
        return 1.0
    total = config.max_steps * config.updates_per_step * config.inner_epochs
    progress = min(1.0, (update - warmup) / max(1, total - warmup - 1))
    return config.min_lr_ratio + (1.0 - config.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_optimizer(parameters, config: TrainConfig) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    """AdamW and its schedule (stepped once per optimizer update, see [`learning_rate_factor`])."""
    parameters = list(parameters)
    if not parameters:
        raise ValueError("The policy has no trainable parameters: check the pipeline's LoRA / fine-tuning options.")
    optimizer = torch.optim.AdamW(
        parameters,
        lr=config.learning_rate,
        betas=tuple(config.adam_betas),
        eps=config.adam_eps,
        weight_decay=config.weight_decay,
        fused=True if config.optim == "adamw_torch_fused" else None,  # None: torch's own choice (foreach on GPUs)
    )
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda update: learning_rate_factor(update, config))
    return optimizer, schedule
