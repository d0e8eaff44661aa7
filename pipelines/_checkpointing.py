"""Gradient (activation) checkpointing of a pipeline's trained model, the ``gradient_checkpointing`` option of every
adapter: each transformer block keeps only its inputs in the forward pass and is run again in the backward pass.
The gradients are the same; activation memory falls from all blocks' to about one block's, for about one extra
forward of the model per backward.

- diffusers models (`sd3`, `flux`, `wan`): ``enable_gradient_checkpointing()``; diffusers checkpoints a block
  whenever gradients are enabled.
- transformers models (`qwen_vl`, `mdlm`): ``activation_checkpointing_enable`` (non-reentrant
  ``torch.utils.checkpoint``: frozen embeddings under LoRA need no input that requires grad). transformers checkpoints
  a layer only while it is in training mode, and mmgrpo's policies run in eval mode (no dropout: a replayed forward
  must give the rollout's log-probabilities). [`checkpoint_transformers`] therefore sets the ``training`` flag of
  each checkpointed layer itself (``module.training``, not ``train()``): its submodules, dropout included, stay in
  eval mode. Sampling runs without gradients and is never checkpointed.

Not a plugin: the name starts with an underscore and it defines no ``PLUGIN``.
"""

from __future__ import annotations

import torch


def checkpoint_diffusers(model: torch.nn.Module, where: str = "pipeline.gradient_checkpointing") -> None:
    """Turns on diffusers' gradient checkpointing of `model`'s blocks (a clear error when the class has none)."""
    if not getattr(model, "_supports_gradient_checkpointing", False):
        raise ValueError(f"{where}: {type(model).__name__} does not support gradient checkpointing; set it to false.")
    model.enable_gradient_checkpointing()


def checkpoint_transformers(model: torch.nn.Module, where: str = "pipeline.gradient_checkpointing") -> list:
    """Turns on transformers' activation checkpointing of `model`'s layers (a peft wrapper is looked through) and
    marks each checkpointed layer as training (its own flag only, see the module docstring).

    Returns:
        `list[torch.nn.Module]`: the checkpointed layers.

    Raises:
        `ValueError`: the model's class does not support activation checkpointing (remote code may not).
    """
    from transformers.modeling_layers import GradientCheckpointingLayer

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if not getattr(base, "supports_gradient_checkpointing", False):
        raise ValueError(f"{where}: {type(base).__name__} does not support activation checkpointing; set it to false.")
    base.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    layers = [m for m in base.modules() if isinstance(m, GradientCheckpointingLayer) and m.gradient_checkpointing]
    if not layers:
        raise ValueError(f"{where}: {type(base).__name__} has no layer transformers can checkpoint; set it to false.")
    for layer in layers:
        layer.training = True  # transformers checkpoints training layers only; submodules (dropout) stay in eval
    return layers
