"""A tiny bidirectional masked-diffusion LM and its offline character tokenizer (tests and the embedded default).

Not a plugin (no ``PLUGIN``): [`tiny_mdlm`] builds a `LlamaForCausalLM` with causal masking disabled
(``config.is_causal = False``: every position attends to every other, as LLaDA) over a character-level
`PreTrainedTokenizerFast` built in memory (no download), and can write both to a folder that
``pipeline.pretrained`` accepts.
"""

from __future__ import annotations

from pathlib import Path

SPECIALS = ["<pad>", "<bos>", "<eos>", "<mask>"]
CHARACTERS = list("0123456789+-*=?:() ")


def char_tokenizer(characters: list[str] | None = None):
    """A character-level fast tokenizer: one token per character of `characters`, plus ``<pad>`` (0), ``<bos>``
    (1), ``<eos>`` (2) and ``<mask>`` (3); unknown characters are dropped."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(SPECIALS + (characters or CHARACTERS))}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>", mask_token="<mask>",
        unk_token="<pad>", clean_up_tokenization_spaces=False,
    )


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
