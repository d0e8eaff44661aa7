"""The compiled decode step of the Qwen-VL adapter (``pipeline.compile_decode``): one completion token of every sample
through the language model's modules (token embedding, decoder layers, final norm, LM head), as [`LeanStep`] runs it
with a static cache, under ``torch.compile``.

The compiled function takes everything that changes from one token to the next as a tensor: the token ids, the
step's row of the precomputed attention mask and its rotary cos / sin. The cache's write position is the static
cache's own counter tensor. So one graph serves every token of a rollout, with no graph break (``fullgraph=True``).
Its shapes are static at the first call; a call with another shape (another number of samples, or another prompt
length) compiles once more with dynamic shapes, which then serve every shape (torch's automatic dynamic shapes).

Its attention is [`decode_attention`]: the query heads that share a key / value head packed as that head's queries, as
transformers' sdpa attention packs them eagerly for one query token, and the attention written out (two batched
matrix products around a softmax), which the compiler fuses. transformers' own sdpa function, under ``torch.compile``,
repeats the keys and values of a grouped-query model to every query head instead: a copy of the whole cache per layer
and step, whose cost grows with the rows and the cache length (with it the compiled step lost to the eager one at 32
rows of the tiny model). And torch's fused attention kernel for the CPU costs more than the written-out form for one
query token: it took about 60 us a call at 16 rows of the tiny model, and the written-out form made the step (two
attention calls) about 55 us shorter. [`use_decode_attention`] switches the
language model's attention to it for a rollout (the decode loop switches it back when the rollout ends).

On the CPU the compiled step runs under inductor's C++ wrapper (``cpp_wrapper``): the graph's kernels are called from
C++ rather than from generated Python, about 80 us less per call of the tiny model's step at 16 rows.

The weights stay inputs of the graph (no freezing): an optimizer step that updates them in place is seen by the next
rollout without recompiling.

Not a plugin: the name starts with an underscore and it defines no ``PLUGIN``.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch

# the families whose decode step compiles to one graph: full-attention layers only (a static cache). Qwen3.5's
# linear-attention layers keep a dynamic cache that grows at every token.
COMPILED_FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe")
DECODE_ATTENTION = "mmgrpo_decode_sdpa"  # the name [`decode_attention`] is registered under in transformers


def decode_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor, dropout: float = 0.0, scaling: float | None = None,
                     **kwargs) -> tuple[torch.Tensor, None]:
    """Attention of one query token per row, the query heads that share a key / value head packed as that head's
    queries (transformers' ``pack_gqa``, as its sdpa attention runs eagerly for one token), so the cache is read in
    place; written out as ``softmax(q k^T * scaling + mask) v``.

    Args:
        module: the attention module (its ``num_key_value_groups``).
        query (`torch.FloatTensor` of shape `[N, heads, 1, D]`), key, value (`torch.FloatTensor` of shape
            `[N, kv_heads, K, D]`): the step's queries and the cache's keys and values.
        attention_mask (`torch.FloatTensor` of shape `[N, 1, 1, K]`): the additive mask (0 or -inf; every row sees
            at least its own token).
        dropout (`float`): the attention dropout (transformers passes 0 outside training).
        scaling (`float`, *optional*): the scale of the scores (default ``D ** -0.5``).

    Returns:
        `tuple`: the attention output `[N, 1, heads, D]` and None (no weights).
    """
    from transformers.integrations.sdpa_attention import pack_gqa

    groups = module.num_key_value_groups
    if groups > 1:
        query, attention_mask = pack_gqa(query, groups), pack_gqa(attention_mask, groups)  # [N, kv_heads, groups, D]
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    scores = torch.matmul(query, key.transpose(-1, -2)) * scale + attention_mask  # [N, kv_heads, groups, K]
    weights = torch.nn.functional.dropout(scores.softmax(dim=-1), p=dropout, training=dropout > 0)
    out = torch.matmul(weights, value)  # [N, kv_heads, groups, D]
    return out.reshape(out.shape[0], -1, 1, value.shape[-1]).transpose(1, 2).contiguous(), None  # [N, 1, heads, D]


def token_logits(embed: torch.nn.Module, layers: list[torch.nn.Module], kinds: list[str], norm: torch.nn.Module,
                 head: torch.nn.Module, cache, tokens: torch.Tensor, mask: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor) -> torch.Tensor:
    """The next logits after one completion token of every sample (eagerly, or compiled by [`compiled`]).

    Args:
        embed, layers, norm, head: the language model's token embedding, decoder layers, final norm and the LM head.
        kinds (`list[str]`): each layer's kind; a ``"full_attention"`` layer takes `mask`, the others none (as
            transformers passes in single-token decoding).
        cache: the cache the layers write this token's keys and values (or recurrent states) into.
        tokens (`torch.LongTensor` of shape `[N]`): the token of every sample.
        mask (`torch.FloatTensor` of shape `[N, 1, 1, K]`): the step's attention mask over the cache's `K` positions.
        cos, sin (`torch.FloatTensor` of shape `[N, 1, D]`): the step's rotary tables.

    Returns:
        `torch.FloatTensor` of shape `[N, V]`: the logits.
    """
    hidden = embed(tokens[:, None])  # [N, 1, H]
    for layer, kind in zip(layers, kinds):
        hidden = layer(hidden, attention_mask=mask if kind == "full_attention" else None, position_ids=None,
                       cache=cache, use_cache=True, position_embeddings=(cos, sin))
    return head(norm(hidden)[:, -1])  # [N, V]


@functools.cache
def register_decode_attention() -> None:
    """Registers [`decode_attention`] in transformers' attention functions (once per process)."""
    from transformers import AttentionInterface

    AttentionInterface.register(DECODE_ATTENTION, decode_attention)


@functools.cache
def compiled(device_type: str) -> Callable:
    """[`token_logits`] under ``torch.compile`` for tensors on `device_type` (one wrapper per process and device type:
    its compiled graphs serve every rollout), with inductor's C++ wrapper on the CPU. The attention it calls is
    registered by [`use_decode_attention`], which the decode loop calls first."""
    options = {"cpp_wrapper": True} if device_type == "cpu" else None
    return torch.compile(token_logits, fullgraph=True, dynamic=None, options=options)


def use_decode_attention(config) -> str:
    """Switches the attention of the language model's `config` to [`decode_attention`]; returns the implementation to
    set back when the rollout ends."""
    register_decode_attention()
    saved = config._attn_implementation
    config._attn_implementation = DECODE_ATTENTION
    return saved


def compiled_token_logits(embed: torch.nn.Module, layers: list[torch.nn.Module], kinds: list[str],
                          norm: torch.nn.Module, head: torch.nn.Module, cache, tokens: torch.Tensor, mask: torch.Tensor,
                          cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """[`token_logits`], compiled for the device of `tokens` (the language model's attention switched by
    [`use_decode_attention`])."""
    return compiled(tokens.device.type)(embed, layers, kinds, norm, head, cache, tokens, mask, cos, sin)
