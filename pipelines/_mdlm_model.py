"""Loading the masked-diffusion LM of the `mdlm` pipeline: its family (LLaDA, Dream or a generic transformers model
made bidirectional) with the family's LoRA targets, logit shift and end-of-turn tokens, the mask and EOS token ids,
and the LoRA adapter on the linear layers that exist.

Not a plugin: the name starts with an underscore and it defines no ``PLUGIN``.
"""

from __future__ import annotations

import torch

from mmgrpo.hub import DTYPES, resolve_pretrained

# family -> (LoRA targets, whether logit j predicts token j + 1, extra end-of-turn tokens)
FAMILIES = {
    # LLaDA's blocks name their projections q/k/v_proj, attn_out, ff_proj, up_proj, ff_out (no o/gate/down_proj)
    "llada": (["q_proj", "k_proj", "v_proj", "attn_out", "ff_proj", "up_proj", "ff_out"], False, ["<|eot_id|>"]),
    "dream": (["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], True, ["<|im_end|>"]),
    "generic": (["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "query", "key", "value"],
                False, []),
}


def make_bidirectional(model: torch.nn.Module) -> torch.nn.Module:
    """Turns off causal masking in a transformers decoder (the config flag and every module's ``is_causal``)."""
    model.config.is_causal = False
    for module in model.modules():
        if hasattr(module, "is_causal"):
            module.is_causal = False
    return model


def load_model(config):
    """``(model, tokenizer, family)`` for an `MDLMConfig`: remote code for LLaDA / Dream, a bidirectional stock model
    else; the model frozen and in eval mode."""
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoModelForMaskedLM, AutoTokenizer

    kwargs = {"revision": config.revision, "trust_remote_code": config.trust_remote_code}
    location = resolve_pretrained(config.pretrained, "pipeline.pretrained")
    try:
        model_config = AutoConfig.from_pretrained(location, **kwargs)
    except ValueError as err:
        raise ValueError(
            f"pipeline.pretrained {config.pretrained!r} could not be configured ({err}). LLaDA and Dream ship their "
            "code on the hub: set pipeline.trust_remote_code: true (and pin pipeline.revision)."
        ) from err
    family = config.family
    if family == "auto":
        kind = str(getattr(model_config, "model_type", "")).lower()
        family = "llada" if kind.startswith("llada") else "dream" if kind == "dream" else "generic"
    dtype = DTYPES[config.weights_dtype]
    tokenizer = AutoTokenizer.from_pretrained(location, **kwargs)
    if family in ("llada", "dream"):
        model = AutoModel.from_pretrained(location, dtype=dtype, use_safetensors=True, **kwargs)
    elif any("MaskedLM" in a for a in getattr(model_config, "architectures", None) or []):
        model = AutoModelForMaskedLM.from_pretrained(location, dtype=dtype, use_safetensors=True, **kwargs)
    else:
        model = AutoModelForCausalLM.from_pretrained(location, dtype=dtype, use_safetensors=True, **kwargs)
        model = make_bidirectional(model)
    return model.requires_grad_(False).eval(), tokenizer, family


def mask_token_id(config, model, tokenizer) -> int:
    """The mask token: ``config.mask_token_id``, else the model config's, else the tokenizer's."""
    for value in (config.mask_token_id, getattr(model.config, "mask_token_id", None), tokenizer.mask_token_id):
        if value is not None:
            return int(value)
    raise ValueError("No mask token id: set pipeline.mask_token_id (LLaDA: 126336, Dream: 151666).")


def eos_token_ids(config, tokenizer, end_of_turn: list[str]) -> list[int]:
    """The tokens that end a completion: ``config.eos_token_ids``, else the tokenizer's EOS plus the family's
    end-of-turn tokens that exist."""
    if config.eos_token_ids:
        return list(config.eos_token_ids)
    ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    vocab = tokenizer.get_vocab()
    ids += [vocab[t] for t in end_of_turn if t in vocab and vocab[t] not in ids]
    if not ids:
        raise ValueError("The tokenizer has no EOS token: set pipeline.eos_token_ids.")
    return ids


def lora_targets(model: torch.nn.Module, wanted: list[str], defaults: bool) -> list[str]:
    """The target names that exist in `model` (peft ignores missing names silently; we refuse them)."""
    names = {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    present = [t for t in wanted if t in names]
    missing = [t for t in wanted if t not in names]
    if (missing and not defaults) or not present:
        raise ValueError(
            f"LoRA targets {missing or wanted} are not linear layers of this model; its linear layers are named "
            f"{sorted(names)}: set pipeline.lora_targets from these."
        )
    return present


def add_lora(model: torch.nn.Module, config, family_targets: list[str]) -> torch.nn.Module:
    """`model` wrapped by peft with a LoRA adapter (``config.lora_rank``, ``lora_alpha``) on ``config.lora_targets``
    or, unset, the family's targets that exist; the adapter's parameters in float32."""
    from peft import LoraConfig, get_peft_model

    targets = lora_targets(model, config.lora_targets or family_targets, config.lora_targets is None)
    model = get_peft_model(model, LoraConfig(r=config.lora_rank, lora_alpha=config.lora_alpha, lora_dropout=0.0,
                                             target_modules=targets))
    model.peft_config["default"].base_model_name_or_path = config.pretrained  # as configured, not resolved
    for param in model.parameters():
        if param.requires_grad:
            param.data = param.data.float()
    return model
