"""The one optimizer builder: AdamW over the policy's trainable parameters, with linear warm-up."""

from __future__ import annotations

import torch

from .config import TrainConfig


def build_optimizer(parameters, config: TrainConfig) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    """AdamW and a warm-up-then-constant schedule (stepped once per optimizer update)."""
    parameters = list(parameters)
    if not parameters:
        raise ValueError("The policy has no trainable parameters: check the pipeline's LoRA / fine-tuning options.")
    optimizer = torch.optim.AdamW(
        parameters,
        lr=config.learning_rate,
        betas=tuple(config.adam_betas),
        eps=config.adam_eps,
        weight_decay=config.weight_decay,
    )
    warmup = config.warmup_steps
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda n: min(1.0, (n + 1) / warmup) if warmup else 1.0)
    return optimizer, schedule
