"""Prompt collation and the prefix-shared group forward of the Qwen-VL adapter (`qwen_vl`).

The `G` completions of one prompt share its text and vision tokens. [`GroupForward`] runs the vision tower and the
prompt once per *unique* prompt (``U`` rows), expands the prompt's KV cache to the `N` samples with an index (a
differentiable ``index_select``), and runs only the completion tokens per sample. Multimodal rotary positions
(M-RoPE): the prompt's 3-D positions come from the model's own ``get_rope_index``; completion token ``j`` of a sample
sits at text position ``max(prompt positions) + 1 + j`` on all three axes, which is what the model computes for the
whole sequence (tested against the naive forward, [`GroupForward.naive`]).

Hybrid models (Qwen3.5's Gated DeltaNet layers) cache a convolution and a recurrent state per linear-attention layer
instead of keys and values; ``reorder_cache`` expands them to the group the same way. transformers writes the new
recurrent state into the cached tensor in place, after the continuation has read it as its initial state; the training
forward keeps a copy of that tensor where autograd saves it ([`preserve_states`]), so gradients flow through it.

Not a plugin: the name starts with an underscore and it defines no ``PLUGIN``.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch

VISION_KEYS = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw", "second_per_grid_ts")


def collate_prompts(prompts: list[dict[str, torch.Tensor]], pad_id: int, device) -> dict[str, Any]:
    """Left-pads `U` encoded prompts into one batch.

    Args:
        prompts (`list[dict]`): each with ``input_ids`` `[L_u]`, ``mm_token_type_ids`` `[L_u]` and the processor's
            vision tensors (``pixel_values`` `[patches_u, D]`, ``image_grid_thw`` `[images_u, 3]`, video
            counterparts, ``second_per_grid_ts`` `[videos_u]`), as written by the adapter's prompt encoder.

    Returns:
        `dict`: ``input_ids`` `[U, P]`, ``attention_mask`` `[U, P]`, ``mm_token_type_ids`` `[U, P]` and the vision
        tensors concatenated in prompt order (absent when no prompt has them).
    """
    length = max(int(p["input_ids"].shape[0]) for p in prompts)
    ids = torch.full((len(prompts), length), pad_id, dtype=torch.long)
    mask = torch.zeros(len(prompts), length, dtype=torch.long)
    types = torch.zeros(len(prompts), length, dtype=torch.long)
    for row, p in enumerate(prompts):
        size = p["input_ids"].shape[0]
        ids[row, length - size:] = p["input_ids"]
        mask[row, length - size:] = 1
        types[row, length - size:] = p["mm_token_type_ids"]
    out = {"input_ids": ids.to(device), "attention_mask": mask.to(device), "mm_token_type_ids": types.to(device)}
    for key in VISION_KEYS:
        parts = [p[key] for p in prompts if key in p]
        if parts:
            out[key] = torch.cat(parts).to(device)
    return out


def expand_prefix(prefix: dict[str, torch.Tensor], inverse: torch.Tensor) -> dict[str, torch.Tensor]:
    """A collated prefix of `U` prompts repeated to `N` rows (`inverse` `[N]`), vision tensors included (each row
    carries its own copy of its prompt's patches, as a naive implementation does)."""
    out = {k: prefix[k][inverse.to(prefix[k].device)] for k in ("input_ids", "attention_mask", "mm_token_type_ids")}
    for kind, count_key in (("pixel_values", "image_grid_thw"), ("pixel_values_videos", "video_grid_thw")):
        if kind not in prefix:
            continue
        grids = prefix[count_key]  # [items, 3]
        per_item = grids.prod(dim=1).tolist()
        items_per_row = _items_per_row(prefix, count_key)
        patches = list(prefix[kind].split(per_item))
        grid_rows = list(grids.split(1))
        ts_rows = list(prefix["second_per_grid_ts"].split(1)) if kind == "pixel_values_videos" and "second_per_grid_ts" in prefix else None
        starts = [sum(items_per_row[:u]) for u in range(len(items_per_row))]
        chosen = [i for u in inverse.tolist() for i in range(starts[u], starts[u] + items_per_row[u])]
        out[kind] = torch.cat([patches[i] for i in chosen])
        out[count_key] = torch.cat([grid_rows[i] for i in chosen])
        if ts_rows is not None:
            out["second_per_grid_ts"] = torch.cat([ts_rows[i] for i in chosen])
    return out


def _items_per_row(prefix: dict[str, torch.Tensor], count_key: str) -> list[int]:
    """How many images (or videos) each prompt row holds, from its number of image (or video) tokens: item `i` has
    ``prod(grid_i) / merge**2`` of them, and the items are in row order. (Counting runs of tokens would miscount the
    Qwen3 families' videos, whose frames are runs of their own between timestamps.)"""
    kind = 1 if count_key == "image_grid_thw" else 2
    per_row = (prefix["mm_token_type_ids"] == kind).sum(dim=1).tolist()  # [U] tokens of this kind
    sizes = prefix[count_key].prod(dim=1)  # [items] patches
    merge_area = int(sizes.sum()) // max(sum(per_row), 1)  # patches per token (spatial merge squared)
    counts, item = [], 0
    for tokens in per_row:
        start = item
        while tokens > 0:
            tokens -= int(sizes[item]) // merge_area
            item += 1
        counts.append(item - start)
    return counts


def unique_rows(items: list[Any]) -> tuple[list[Any], torch.Tensor]:
    """Distinct objects of `items` (by identity, in first-seen order) and ``inverse`` `[N]` mapping items to them."""
    seen: dict[int, int] = {}
    unique, inverse = [], []
    for item in items:
        key = id(item)
        if key not in seen:
            seen[key] = len(unique)
            unique.append(item)
        inverse.append(seen[key])
    return unique, torch.tensor(inverse, dtype=torch.long)


def rope_positions(model, prefix: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """M-RoPE positions of the prompts, `[3, U, P]`, and the text position of each prompt's first completion token,
    `[U]` (``max`` over the prompt's positions + 1), from the model's own ``get_rope_index``."""
    kwargs = {k: prefix[k] for k in ("image_grid_thw", "video_grid_thw", "second_per_grid_ts") if k in prefix}
    if "second_per_grid_ts" in kwargs and "second_per_grid_ts" not in _rope_arguments(model):
        kwargs.pop("second_per_grid_ts")
    positions, _ = model.model.get_rope_index(
        prefix["input_ids"], mm_token_type_ids=prefix["mm_token_type_ids"], attention_mask=prefix["attention_mask"],
        **kwargs,
    )
    positions = positions.masked_fill(prefix["attention_mask"][None] == 0, 0)  # [3, U, P]
    return positions, positions.amax(dim=(0, 2)) + 1  # [3, U, P], [U]


def _rope_arguments(model) -> set[str]:
    import inspect

    return set(inspect.signature(model.model.get_rope_index).parameters)


def preserve_states(cache) -> contextlib.AbstractContextManager:
    """A context in which autograd saves a copy of the cache's linear-attention recurrent states (not the tensors that
    transformers then overwrites in place); a no-op for a cache without them."""
    from transformers.cache_utils import LinearAttentionCacheLayerMixin

    states = {state.data_ptr() for layer in cache.layers if isinstance(layer, LinearAttentionCacheLayerMixin)
              for state in layer.recurrent_states.values() if state is not None}
    if not states:
        return contextlib.nullcontext()
    return torch.autograd.graph.saved_tensors_hooks(
        lambda tensor: tensor.clone() if tensor.data_ptr() in states else tensor, lambda tensor: tensor
    )


@dataclass
class PromptStates:
    """The forward of `U` prompts, which decoding and the completions' forward continue from.

    Args:
        logits (`torch.FloatTensor` of shape `[U, V]`): the last prompt token's logits.
        cache: the model's KV cache of the `U` prompts (`P` positions).
        mask (`torch.LongTensor` of shape `[U, P]`): the prompts' attention mask (left padding 0).
        start (`torch.LongTensor` of shape `[U]`): the text position of each prompt's first completion token.
    """

    logits: torch.Tensor
    cache: Any
    mask: torch.Tensor
    start: torch.Tensor

    def expand(self, inverse: torch.Tensor) -> tuple[torch.Tensor, Any, torch.Tensor, torch.Tensor]:
        """The states of `N` samples, `inverse` `[N]` -> prompt row: logits `[N, V]`, the cache expanded in place
        (``index_select`` per layer: gradients flow to the prompt), mask `[N, P]` and start `[N]`."""
        inverse = inverse.to(self.logits.device)
        self.cache.reorder_cache(inverse)  # [U, ...] -> [N, ...] per layer
        return self.logits[inverse], self.cache, self.mask[inverse], self.start[inverse]


class GroupForward(torch.nn.Module):
    """Per-token log-probabilities of completions, with the prompt (and its vision tokens) forwarded once per group.

    One module, so that a DDP / FSDP wrapper sees one forward per backward. Vision special tokens are excluded from
    the policy's support (their logits are set to -inf), in sampling and in scoring alike.

    Args:
        model: a Qwen-VL ``...ForConditionalGeneration`` (see `_qwen_vl_config.FAMILIES`).
        suppress_ids (`list[int]`): token ids the policy never emits.
    """

    def __init__(self, model, suppress_ids: list[int]):
        super().__init__()
        self.model = model
        self.register_buffer("suppress", torch.tensor(sorted(set(suppress_ids)), dtype=torch.long), persistent=False)

    def token_log_probs(self, logits: torch.Tensor, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
        """``log softmax(logits / temperature)`` at `tokens`: logits `[N, T, V]`, tokens `[N, T]` -> `[N, T]`
        (float32), vision special tokens excluded from the support."""
        return self.log_softmax(logits, temperature).gather(-1, tokens[..., None]).squeeze(-1)

    def log_softmax(self, logits: torch.Tensor, temperature: float) -> torch.Tensor:
        logits = logits.float() / temperature if temperature != 1.0 else logits.float()  # x / 1 == x: one op less
        if self.suppress.numel():
            logits = logits.index_fill(-1, self.suppress.to(logits.device), float("-inf"))
        return logits.log_softmax(-1)

    def prompt_states(self, prefix: dict[str, torch.Tensor]) -> PromptStates:
        """Forwards the `U` collated prompts (and their images) once: [`PromptStates`] of `U` rows."""
        positions, start = rope_positions(self.model, prefix)
        vision = {k: prefix[k] for k in VISION_KEYS if k in prefix and k != "second_per_grid_ts"}
        if "second_per_grid_ts" in prefix and "second_per_grid_ts" in _rope_arguments(self.model):
            vision["second_per_grid_ts"] = prefix["second_per_grid_ts"]
        out = self.model(
            input_ids=prefix["input_ids"], attention_mask=prefix["attention_mask"], position_ids=positions,
            mm_token_type_ids=prefix["mm_token_type_ids"], use_cache=True, logits_to_keep=1, **vision,
        )
        return PromptStates(out.logits[:, -1], out.cache, prefix["attention_mask"], start)

    def step(self, tokens: torch.Tensor, cache, attention_mask: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Forwards new tokens `[N, t]` after the cache; `positions` `[N, t]` text positions (same on the three
        M-RoPE axes); `attention_mask` `[N, P + past + t]`. Returns logits `[N, t, V]`."""
        out = self.model(
            input_ids=tokens, attention_mask=attention_mask, position_ids=positions[None].expand(3, -1, -1),
            cache=cache, use_cache=True,
        )
        return out.logits

    def forward(self, prefix: dict[str, torch.Tensor], inverse: torch.Tensor, completion: torch.Tensor,
                temperature: float, shared: bool = True) -> torch.Tensor:
        """Log-probs `[N, T]` of `completion` `[N, T]` after prompts `prefix` (`U` rows), `inverse` `[N]` -> row.
        ``shared=False`` runs [`~GroupForward.naive`] on the prompts expanded to `N` rows instead."""
        if not shared:
            return self.naive(expand_prefix(prefix, inverse), completion, temperature)
        return self.continuation(*self.prompt_states(prefix).expand(inverse), completion, temperature)

    def continuation(self, first: torch.Tensor, cache, prompt_mask: torch.Tensor, start: torch.Tensor,
                     completion: torch.Tensor, temperature: float) -> torch.Tensor:
        """Log-probs `[N, T]` of `completion` `[N, T]` after the prompts' states of `N` samples (as
        [`PromptStates.expand`] gives them): `first` `[N, V]`, `cache`, `prompt_mask` `[N, P]`, `start` `[N]`."""
        n, length = completion.shape
        logits = first[:, None]  # [N, 1, V]
        if length > 1:
            positions = start[:, None] + torch.arange(length - 1, device=start.device)  # [N, T - 1]
            mask = torch.cat([prompt_mask, prompt_mask.new_ones(n, length - 1)], dim=1)  # [N, P + T - 1]
            with preserve_states(cache):
                rest = self.step(completion[:, :-1], cache, mask, positions)  # [N, T - 1, V]
            logits = torch.cat([logits, rest], dim=1)  # [N, T, V]
        return self.token_log_probs(logits, completion, temperature)

    def naive(self, prefix: dict[str, torch.Tensor], completion: torch.Tensor, temperature: float) -> torch.Tensor:
        """The reference forward: every sample carries its own prompt and images (`prefix` has `N` rows) and the
        model computes its own M-RoPE positions over the whole sequence. Log-probs `[N, T]`."""
        n, length = completion.shape
        prompt_len = prefix["input_ids"].shape[1]
        ids = torch.cat([prefix["input_ids"], completion], dim=1)  # [N, P + T]
        mask = torch.cat([prefix["attention_mask"], prefix["attention_mask"].new_ones(n, length)], dim=1)
        types = torch.cat([prefix["mm_token_type_ids"], prefix["mm_token_type_ids"].new_zeros(n, length)], dim=1)
        vision = {k: prefix[k] for k in VISION_KEYS if k in prefix}
        if "second_per_grid_ts" in vision and "second_per_grid_ts" not in _rope_arguments(self.model):
            vision.pop("second_per_grid_ts")
        logits = self.model(input_ids=ids, attention_mask=mask, mm_token_type_ids=types, **vision).logits
        return self.token_log_probs(logits[:, prompt_len - 1 : -1], completion, temperature)
