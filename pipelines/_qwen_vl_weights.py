"""The trained weights of the `qwen_vl` policy: a peft LoRA adapter injected in place into the language model's
linear layers (and the vision blocks when the vision tower is trained), the switch that turns it off for the
reference policy, and saving / loading them in peft's format (``adapter_config.json`` +
``adapter_model.safetensors``, which ``PeftModel.from_pretrained`` reads) or, fully fine-tuned, as the whole model.

Not a plugin: the name starts with an underscore and it defines no ``PLUGIN``.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Callable, ContextManager

import torch

LANGUAGE_LORA = r".*language_model.*\.({names})$"
VISION_LORA = r".*visual\.blocks.*\.(qkv|proj|fc1|fc2|linear_fc1|linear_fc2|gate_proj|up_proj|down_proj)$"
# peft's `PeftModel` names the base model's parameters under this prefix: adapters saved with it load there
PEFT_PREFIX = "base_model.model."
LORA_FILE = "adapter_model.safetensors"


def inject_lora(model: torch.nn.Module, config):
    """Injects a peft LoRA adapter into `model`'s language-model linear layers named by ``config.lora_targets``
    (and its vision blocks when ``config.freeze_vision`` is off), in place: the model keeps its transformers class.
    Only the LoRA weights are trainable afterwards, in float32.

    Returns:
        `peft.LoraConfig`: the adapter's configuration (saved beside its weights).

    Raises:
        `ValueError`: no layer matched.
    """
    from peft import LoraConfig, inject_adapter_in_model

    pattern = LANGUAGE_LORA.format(names="|".join(config.lora_targets))
    if not config.freeze_vision:
        pattern = f"({pattern})|({VISION_LORA})"
    lora_config = LoraConfig(
        r=config.lora_rank, lora_alpha=config.lora_alpha, lora_dropout=config.lora_dropout, target_modules=pattern,
        init_lora_weights="gaussian", base_model_name_or_path=config.pretrained,  # as configured, not resolved
    )
    inject_adapter_in_model(lora_config, model)
    for name, param in model.named_parameters():
        if "lora_" in name:
            param.data = param.data.float()  # trainable parameters are always float32
            param.requires_grad_(True)
    if not any(param.requires_grad for param in model.parameters()):
        raise ValueError(f"lora_targets {config.lora_targets} matched no language-model layer of "
                         f"{config.pretrained!r}.")
    return lora_config


def adapters_off(model: torch.nn.Module) -> Callable[[], ContextManager]:
    """A context factory in which `model`'s LoRA layers are disabled (the adapter was injected, so there is no peft
    ``disable_adapter`` context); on exit only the LoRA weights are trainable again."""

    @contextlib.contextmanager
    def off():
        from peft.tuners.tuners_utils import BaseTunerLayer

        layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
        for layer in layers:
            layer.enable_adapters(False)
        try:
            yield
        finally:
            for layer in layers:
                layer.enable_adapters(True)  # this marks the whole layer trainable: keep only LoRA weights trained
                for name, param in layer.named_parameters():
                    param.requires_grad_("lora_" in name)

    return off


def save_weights(model: torch.nn.Module, lora_config, path: str | Path) -> None:
    """Writes the LoRA adapter of `lora_config` in peft's format or, when `lora_config` is None (full fine-tuning),
    the whole model with ``save_pretrained``."""
    Path(path).mkdir(parents=True, exist_ok=True)
    if lora_config is None:
        model.save_pretrained(path)
        return
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import save_file

    lora_config.save_pretrained(path)
    state = get_peft_model_state_dict(model)  # keys of the injected model; PeftModel's carry a prefix
    save_file({PEFT_PREFIX + k: v.detach().contiguous().cpu() for k, v in state.items()}, str(Path(path) / LORA_FILE))


def load_weights(model: torch.nn.Module, lora: bool, path: str | Path) -> None:
    """Loads weights written by [`save_weights`] into `model`: the adapter (`lora`) or the whole model."""
    if lora:
        from peft.utils import set_peft_model_state_dict
        from safetensors.torch import load_file

        state = {k.removeprefix(PEFT_PREFIX): v for k, v in load_file(str(Path(path) / LORA_FILE)).items()}
        result = set_peft_model_state_dict(model, state)
        if getattr(result, "unexpected_keys", None):
            raise ValueError(f"{path}: adapter weights {result.unexpected_keys[:3]}... do not fit this model.")
    else:
        import transformers

        model_cls = getattr(transformers, type(model).__name__)
        loaded = model_cls.from_pretrained(path, dtype=torch.float32, use_safetensors=True)  # never a pickle
        model.load_state_dict(loaded.state_dict())
