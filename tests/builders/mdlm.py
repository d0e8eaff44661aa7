"""Tiny masked-diffusion LM for tests and the shipped base model (`scripts/train_mdlm_arith.py`).

[`tiny_mdlm`] builds a `LlamaForCausalLM` with causal masking disabled (``config.is_causal = False``: every position
attends to every other, as LLaDA) over the character tokenizer of `_tokenizers.char_tokenizer`, and
[`save_tiny_mdlm`] writes both to a folder that ``pipeline.pretrained`` accepts.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from ._tokenizers import char_tokenizer


@pytest.fixture(scope="session")
def tiny_mdlm_dir(tmp_path_factory):
    """A tiny random bidirectional Llama and its character tokenizer, `save_pretrained`."""
    return save_tiny_mdlm(tmp_path_factory.mktemp("tiny_mdlm"))


def build_policy(request):
    """A semi-autoregressive, EOSER LoRA policy on `tiny_mdlm_dir` (8 tokens in blocks of 4, 2 steps each)."""
    from mmgrpo.pipelines.mdlm import MDLMConfig, MDLMPolicy

    path = request.getfixturevalue("tiny_mdlm_dir")
    return MDLMPolicy(MDLMConfig(pretrained=path, gen_length=8, block_length=4, steps_per_block=2, eoser=True, lora_rank=4, lora_alpha=8))


def tiny_mdlm(hidden_size: int = 32, layers: int = 2, heads: int = 4, seed: int = 0, characters: list[str] | None = None):
    """A random tiny bidirectional Llama and its tokenizer, ``(model, tokenizer)``; the model's config carries
    ``mask_token_id`` and is in `eval()` mode."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = char_tokenizer(characters)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=256,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=False, is_causal=False,
    )
    config.mask_token_id = tokenizer.mask_token_id
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    return model, tokenizer


def save_tiny_mdlm(path: str | Path, **kwargs) -> str:
    """Writes [`tiny_mdlm`]'s model and tokenizer to `path` with ``save_pretrained``; returns the path."""
    model, tokenizer = tiny_mdlm(**kwargs)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)
