"""The prompt forward of sampling handed to the first update (``pipeline.share_prompt_forward``) in the Qwen-VL
adapter (`qwen_vl`).

A training step forwards each prompt (and its images) twice: once without gradients, for the KV cache that decoding
continues from, and once in the first update's training forward. With the option on, `QwenVLPolicy.sample` runs the
prompt forward with gradients (under the run's autocast, as the training forward runs) and keeps its `U` prompt
states, graph included, in a [`SharedPromptForward`]; the decode reads them without a graph, as before. The next
`log_prob` with gradients enabled takes them once: when every prompt of its minibatch is one of the kept ones (the
same objects) and the trainable weights have not changed since (their in-place version counters) and the model is in
the same train / eval mode, it selects its rows (``index_select``: gradients flow to the kept forward) and forwards
only the completions; otherwise it forwards the prompts itself. Either way the kept states are dropped then, so the
graph lives from sampling to the first update only.

Only that first update gains: later minibatches, inner epochs, the reference pass (no gradients), an old model's
pass, and any update after the weights changed forward their prompts as without the option. The values are those of
recomputing with the sampling batch's padding (equal to about 1e-6 in float32; bit for bit when the minibatch is the
whole batch in the sampled order).

Not a plugin: the name starts with an underscore and it defines no ``PLUGIN``.
"""

from __future__ import annotations

from typing import Any

import torch

from mmgrpo.pipelines._qwen_vl_forward import PromptStates


def weights_key(parameters: list[torch.Tensor], training: bool) -> tuple[int, bool]:
    """What changes when the weights change in place (a load, an old model's swap, a ``foreach`` or per-parameter
    optimizer step): the sum of the trainable parameters' version counters, and the train / eval mode. torch's fused
    AdamW (``train.optim: adamw_torch_fused``) leaves the counters as they are; in training no optimizer step falls
    between a rollout's sampling and its first update, which is where the kept forward is taken."""
    return sum(p._version for p in parameters), training


class SharedPromptForward:
    """The prompt states one sampling call kept for the next update (see the module docstring)."""

    def __init__(self):
        self.prompts: list[dict] = []  # the encoded prompts of the kept rows (kept alive: identity is the key)
        self.states: PromptStates | None = None  # logits [U, V], mask [U, P], start [U]; the cache as `layers`
        self.layers: list[tuple[torch.Tensor, torch.Tensor]] = []  # per layer: keys, values `[U, kv_heads, P, D]`
        self.parameters: list[torch.Tensor] = []  # the trainable parameters whose versions `key` sums
        self.key: tuple[int, bool] | None = None

    def keep(self, states: PromptStates, prompts: list[dict], parameters: list[torch.Tensor], training: bool) -> None:
        """Keeps the `U` rows of `states` (forwarded with gradients) for `prompts`, before decoding expands them, with
        the state of the trainable `parameters` and the model's `training` mode they were forwarded in."""
        self.prompts, self.parameters, self.key = list(prompts), parameters, weights_key(parameters, training)
        self.layers = [(layer.keys, layer.values) for layer in states.cache.layers]
        self.states = PromptStates(states.logits, None, states.mask, states.start)  # not the cache decoding expands

    def drop(self) -> None:
        self.prompts, self.states, self.layers, self.parameters, self.key = [], None, [], [], None

    def take(self, prompts: list[dict], training: bool, inverse: torch.Tensor, config: Any):
        """The kept states of `N` samples (`prompts` `U'` distinct objects, `inverse` `[N]` -> prompt), as
        [`PromptStates.expand`] gives them, when every prompt was kept and the weights and the `training` mode are
        as they were; else None. Drops the kept states in both cases.

        Args:
            config: the model's config (the cache's layer types).
        """
        from transformers import DynamicCache

        states, layers, kept = self.states, self.layers, {id(p): row for row, p in enumerate(self.prompts)}
        usable = (states is not None and weights_key(self.parameters, training) == self.key
                  and all(id(p) in kept for p in prompts))
        rows = torch.tensor([kept[id(p)] for p in prompts], dtype=torch.long) if usable else None  # [U']
        self.drop()
        if rows is None:
            return None
        index = rows[inverse].to(states.logits.device)  # [N] -> kept row
        cache = DynamicCache(config=config)
        for layer, (keys, values) in enumerate(layers):
            cache.update(keys.index_select(0, index), values.index_select(0, index), layer)
        return states.logits[index], cache, states.mask[index], states.start[index]
