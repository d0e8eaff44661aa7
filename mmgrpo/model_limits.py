"""What a model's own config files say about the sizes a run may ask of it, read without loading weights or reaching
the network, and the fixed ceilings used where they cannot be read.

A pipeline's ``Config.__post_init__`` bounds its sizes with these: completion and sequence lengths by the model's
``max_position_embeddings``, a LoRA rank by the width of the layers it adapts, token ids by the vocabulary, an image
side by the positions a transformer has (SD3's ``pos_embed_max_size``, Wan's ``rope_max_seq_len``). The files are read
from a local model folder (``mmgrpo:<name>`` resolves to one) or, for a hub id, from the local Hugging Face cache
only; a model whose files are in neither gets the generous fixed ceilings below.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from .validation import check_range

# fixed ceilings: far above what any real run uses, far below what hangs or poisons one
TOKEN_LIMIT = 2**20  # tokens of one completion or prompt (no released model takes a million-token sequence)
RESOLUTION_LIMIT = 8192  # pixels of an image or frame side
PIXELS_LIMIT = RESOLUTION_LIMIT**2  # pixels of one image
LORA_RANK_LIMIT = 4096  # LoRA rank (a rank above the adapted layers' width adds nothing)
LORA_RANK_SLACK = 256  # a rank a toy model may exceed its width by: pointless but cheap (the defaults are 32 and 64)
LORA_ALPHA_LIMIT = 65536  # LoRA scaling numerator (scales updates by lora_alpha / lora_rank)
VOCAB_LIMIT = 2**31  # token ids (int32 vocabularies)
GUIDANCE_LIMIT = 100.0  # classifier-free or distilled guidance scale (real runs: 1 to ~20)
SHIFT_LIMIT = 100.0  # flow-matching sigma shift (real models: 1 to ~17)
TEMPERATURE_RANGE = (1e-3, 100.0)  # a sampling temperature: below it logits / temperature overflow, above it is noise
NESTED = ("text_config", "llm_config", "language_config")  # where multimodal configs keep their language model's


def read_json(location: str, filename: str = "config.json") -> dict[str, Any]:
    """`filename` (``config.json``, ``transformer/config.json``...) of model `location` (a local folder or a hub id, as
    [`~mmgrpo.hub.resolve_pretrained`] returns it) as a mapping; ``{}`` when the folder or the local Hugging Face cache
    does not hold it, or it is not a JSON mapping. Never downloads anything."""
    path: Any = Path(location) / filename
    if not Path(location).is_dir():
        try:
            from huggingface_hub import try_to_load_from_cache

            path = try_to_load_from_cache(location, filename)  # the cached file's path, or None / a sentinel
        except Exception:  # an id the hub library refuses: nothing cached
            return {}
        if not isinstance(path, (str, os.PathLike)):
            return {}
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def find_int(config: dict[str, Any], *names: str) -> int | None:
    """The first of `names` that `config` (or its language model's section, ``text_config``...) sets to a positive
    integer, or None."""
    for section in (config, *(config.get(n) for n in NESTED)):
        if not isinstance(section, dict):
            continue
        for name in names:
            value = section.get(name)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None


def max_positions(config: dict[str, Any]) -> int | None:
    """The longest sequence a language model's config allows (``max_position_embeddings``, LLaDA's
    ``max_sequence_length``), or None."""
    return find_int(config, "max_position_embeddings", "max_sequence_length", "n_positions")


def hidden_size(config: dict[str, Any]) -> int | None:
    """A language model's width (``hidden_size``, LLaDA's ``d_model``), or None."""
    return find_int(config, "hidden_size", "d_model", "n_embd")


def attention_width(config: dict[str, Any]) -> int | None:
    """A diffusers transformer's attention width (``num_attention_heads * attention_head_dim``), or None."""
    heads, dim = find_int(config, "num_attention_heads"), find_int(config, "attention_head_dim")
    return heads * dim if heads and dim else None


def check_limit(key: str, value: int | float, low: int | float, model_limit: int | float | None,
                fixed_limit: int | float, what: str, fix: str = "") -> None:
    """[`~mmgrpo.validation.check_range`] of `value` in ``[low, model_limit]`` where the model's config gave a limit
    (the message says it is `what` of the model), else in ``[low, fixed_limit]``."""
    if model_limit is None:
        check_range(key, value, low, fixed_limit, fix=fix)
    else:
        check_range(key, value, low, model_limit,
                    fix=f"{model_limit} is {what} in the model's config" + (f"; {fix}" if fix else ""))


def check_temperature(key: str, value: float, greedy: bool = False) -> None:
    """A sampling temperature in ``TEMPERATURE_RANGE`` (or exactly 0 when `greedy` decoding is allowed)."""
    if greedy and value == 0:
        return
    low, high = TEMPERATURE_RANGE
    check_range(key, value, low, high, fix=("0 decodes greedily, " if greedy else "") + "1.0 samples the model as is")


def check_lora(config, width: int | None) -> None:
    """``lora_rank`` of a pipeline `config` in ``[0, width]`` (the adapted layers' width from the model's config, at
    least ``LORA_RANK_SLACK``; else ``LORA_RANK_LIMIT``) and ``lora_alpha`` in ``[1, LORA_ALPHA_LIMIT]``."""
    if width is None:
        check_range("lora_rank", config.lora_rank, 0, LORA_RANK_LIMIT, fix="0 trains the whole model")
    else:
        check_range("lora_rank", config.lora_rank, 0, max(width, LORA_RANK_SLACK),
                    fix=f"the model's hidden width is {width} (a higher rank adds nothing); 0 trains the whole model")
    check_range("lora_alpha", config.lora_alpha, 1, LORA_ALPHA_LIMIT, fix="LoRA scales by lora_alpha / lora_rank")
