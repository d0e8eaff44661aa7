"""The decode loop of the Qwen-VL adapter (`qwen_vl`): one token per sample and step after the prefix-shared prompt
forward ([`GroupForward.prompt_states`]), with what transformers' forward redoes at every call done once per rollout.

[`LeanStep`] (the default) runs a decode step as the language model's own modules: the token embedding, each decoder
layer, the final norm and the LM head. Once per rollout it

- copies the prompts' keys and values (expanded to the `N` samples) into a transformers ``StaticCache`` of
  ``P + S - 1`` positions, preallocated, which each step writes in place (no growing ``torch.cat``);
- builds every step's attention mask with transformers' own ``create_causal_mask`` (the prompt's padding, causality;
  the format the attention implementation wants), one `[N, 1, S - 1, P + S - 1]` tensor sliced per step;
- computes every step's rotary cos / sin with the model's rotary embedding, on the positions a step would give it
  (completion token ``j`` at text position ``max(prompt positions) + 1 + j`` on the three M-RoPE axes).

A hybrid model (Qwen3.5's linear-attention layers) keeps the prefix's dynamic cache (its recurrent states are updated
in place anyway); its full-attention layers get the same precomputed masks, cut to the keys seen so far, and its
linear-attention layers no mask (transformers passes none in single-token decoding).

A step is [`~_qwen_vl_compile.token_logits`]: eagerly, or with ``compiled`` (``pipeline.compile_decode``), for a model
of full-attention layers only and not sharded, under ``torch.compile`` (see `_qwen_vl_compile.py`).

Under FSDP2 (``train.sharding``) each decoder layer gathers its own parameters when called, as in the model's forward;
the parameters outside the layers (embedding, final norm, LM head), which the sharded model's own forward would
gather, are gathered once per rollout ([`LeanStep.finish`] frees them), so every world size samples the same tokens.

[`ModelStep`] forwards each step through the whole model (the mask and rotary rebuilt by transformers, a growing
cache): the loop's path when the model uses an attention implementation other than ``sdpa`` / ``eager`` (flash
attention reads 2-D masks), and the reference the lean step is tested against.

[`decode`] is the loop itself: the log-softmax of the tempered policy (vision tokens excluded), the draw, the record
of tokens and log-probs into preallocated `[N, S]` tensors and the end-of-turn test, batched over the samples.

Not a plugin: the name starts with an underscore and it defines no ``PLUGIN``.
"""

from __future__ import annotations

from typing import Callable

import torch

from mmgrpo.pipelines._qwen_vl_compile import compiled_token_logits, token_logits, use_decode_attention
from mmgrpo.sharding import any_process

LEAN_ATTENTION = ("sdpa", "eager")  # attention implementations that take a 4-D mask (what LeanStep precomputes)
LEAN_LAYERS = ("full_attention", "linear_attention")  # decoder layer types LeanStep drives


def layer_kinds(model) -> list[str]:
    """The kind of each decoder layer of `model`'s language model (transformers' reading of its config, as its caches
    are built)."""
    from transformers.cache_utils import get_layer_types_and_kwargs

    config = model.model.language_model.config
    return get_layer_types_and_kwargs(config)[0][: config.num_hidden_layers]


def lean_supported(model) -> bool:
    """Whether [`LeanStep`] can drive `model`: a 4-D-mask attention implementation and decoder layers of the kinds it
    knows."""
    return model.config._attn_implementation in LEAN_ATTENTION and all(k in LEAN_LAYERS for k in layer_kinds(model))


class ModelStep:
    """A decode step through the model's forward (the prompt's cache grows by one position per step).

    Args:
        module ([`GroupForward`]): the group forward whose ``step`` runs the model.
        cache: the prefix's cache, expanded to the `N` samples.
        prompt_mask (`torch.LongTensor` of shape `[N, P]`), start (`torch.LongTensor` of shape `[N]`): the prompts'
            attention mask and each sample's first completion position.
    """

    def __init__(self, module, cache, prompt_mask: torch.Tensor, start: torch.Tensor):
        self.module, self.cache, self.attention, self.start = module, cache, prompt_mask, start

    def __call__(self, tokens: torch.Tensor, t: int) -> torch.Tensor:
        """Forwards completion token `t` of every sample, `tokens` `[N]`; returns the next logits `[N, V]`."""
        self.attention = torch.cat([self.attention, self.attention.new_ones(len(tokens), 1)], dim=1)  # [N, P + t + 1]
        positions = (self.start + t)[:, None]  # [N, 1]
        return self.module.step(tokens[:, None], self.cache, self.attention, positions)[:, -1]

    def finish(self) -> None:
        """Nothing to free."""


class LeanStep:
    """A decode step as the language model's modules, with the cache, masks and rotary tables set up once per rollout
    (see the module docstring).

    Args:
        model: the Qwen-VL ``...ForConditionalGeneration`` ([`lean_supported`]).
        cache: the prefix's dynamic cache, expanded to the `N` samples (copied into a static cache unless the model has
            linear-attention layers).
        prompt_mask (`torch.LongTensor` of shape `[N, P]`), start (`torch.LongTensor` of shape `[N]`): as for
            [`ModelStep`].
        steps (`int`): the completion tokens to decode, `S` (tokens ``0 .. S - 2`` are forwarded).
        compiled (`bool`): run each step compiled when the model allows it (static cache, not sharded).
    """

    def __init__(self, model, cache, prompt_mask: torch.Tensor, start: torch.Tensor, steps: int,
                 compiled: bool = False):
        from torch.distributed.fsdp import FSDPModule
        from transformers.cache_utils import StaticCache
        from transformers.masking_utils import create_causal_mask

        self.sharded = model if isinstance(model, FSDPModule) else None
        if self.sharded is not None:  # the parameters outside the decoder layers, gathered for the rollout
            self.sharded.unshard()
        text = model.model.language_model
        self.head, self.embed, self.norm, self.text_config = model.lm_head, text.embed_tokens, text.norm, text.config
        self.layers = list(text.layers[: text.config.num_hidden_layers])
        self.kinds = layer_kinds(model)
        n, prompt = prompt_mask.shape
        fed = max(steps - 1, 1)
        self.static = all(kind == "full_attention" for kind in self.kinds)
        if self.static:  # the prompt's keys and values written once into preallocated buffers of P + S - 1 positions
            static = StaticCache(config=model.config, max_cache_len=prompt + fed)
            for index, layer in enumerate(cache.layers):
                static.update(layer.keys, layer.values, index)
            cache = static
        self.cache, self.prompt = cache, prompt
        dtype = self.embed.weight.dtype
        shape = torch.zeros((), dtype=dtype, device=prompt_mask.device).expand(n, fed, text.config.hidden_size)
        attention = torch.cat([prompt_mask, prompt_mask.new_ones(n, fed)], dim=1)  # [N, P + S - 1]
        self.masks = create_causal_mask(config=text.config, inputs_embeds=shape, attention_mask=attention, cache=cache,
                                        allow_is_causal_skip=False)  # [N, 1, S - 1, P + S - 1]
        if self.masks.dtype == torch.bool:  # sdpa's own conversion (0 / -inf), done once instead of at every call
            self.masks = torch.zeros(self.masks.shape, dtype=dtype, device=self.masks.device).masked_fill_(
                ~self.masks, float("-inf"))
        positions = start[:, None] + torch.arange(fed, device=start.device)  # [N, S - 1]
        cos, sin = text.rotary_emb(shape, positions[None].expand(3, -1, -1))  # [N, S - 1, D] each
        self.rotary = [(cos[:, t : t + 1], sin[:, t : t + 1]) for t in range(fed)]
        self.compiled = compiled and self.static and self.sharded is None
        # the attention the compiled step runs, for the rollout (finish() sets the model's own back)
        self.own_attention = use_decode_attention(self.text_config) if self.compiled else None

    def __call__(self, tokens: torch.Tensor, t: int) -> torch.Tensor:
        """Forwards completion token `t` of every sample, `tokens` `[N]`; returns the next logits `[N, V]`."""
        keys = self.masks.shape[-1] if self.static else self.prompt + t + 1  # the dynamic cache holds P + t + 1
        mask = self.masks[:, :, t : t + 1, :keys]  # [N, 1, 1, keys]
        args = (self.embed, self.layers, self.kinds, self.norm, self.head, self.cache, tokens, mask, *self.rotary[t])
        return compiled_token_logits(*args) if self.compiled else token_logits(*args)

    def finish(self) -> None:
        """Frees the parameters gathered for the rollout (sharded models); sets the model's attention back (compiled)."""
        if self.sharded is not None:
            self.sharded.reshard()
        if self.own_attention is not None:
            self.text_config._attn_implementation = self.own_attention


class TokenSampler:
    """The next tokens of every sample from the policy's log-probs: argmax (greedy), or a draw after top-k / top-p
    truncation by torch.multinomial's own rule for one draw, the exponential race ``argmax_v p_v / E_v`` with ``E_v ~
    Exp(1)`` drawn from `generator` (the same numbers ``torch.multinomial(p, 1, generator=generator)`` draws, so the
    same tokens, without its checks). A token of probability 0 never wins; the winner barely moves under a small
    perturbation of `p` (the runs at one and two processes sample alike). The exponentials are drawn where the
    generator lives (the CPU for the trainer's) and moved to the log-probs' device.

    Args:
        greedy (`bool`): argmax instead of a draw.
        top_k (`int`): keep the `top_k` most likely tokens (0: all).
        top_p (`float`): keep the smallest set of most likely tokens whose mass reaches `top_p` (1: all).
        generator (`torch.Generator`, *optional*): the generator of the draws.
    """

    def __init__(self, *, greedy: bool, top_k: int, top_p: float, generator: torch.Generator | None):
        self.greedy, self.top_k, self.top_p, self.generator = greedy, top_k, top_p, generator

    def __call__(self, logp: torch.Tensor) -> torch.Tensor:
        """Tokens `[N]` from log-probs `[N, V]`."""
        if self.greedy:
            return logp.argmax(dim=-1)
        probs = logp.exp()  # [N, V]
        if self.top_k > 0:
            kth = probs.topk(min(self.top_k, probs.shape[-1]), dim=-1).values[:, -1:]
            probs = torch.where(probs >= kth, probs, torch.zeros_like(probs))
        if self.top_p < 1.0:
            sorted_probs, order = probs.sort(dim=-1, descending=True)
            cumulative = sorted_probs.cumsum(dim=-1)
            drop = cumulative - sorted_probs > self.top_p * cumulative[:, -1:]  # keeps at least the top token
            probs = probs.scatter(-1, order, sorted_probs.masked_fill(drop, 0.0))
        return (probs / self.exponentials(probs).to(probs.device)).argmax(dim=-1)  # [N]

    def exponentials(self, probs: torch.Tensor) -> torch.Tensor:
        """``Exp(1)`` draws of `probs`' shape and dtype, where the generator lives, as ``exponential_`` draws them. For
        float32 on the CPU they are computed as its kernel computes them, about 3x faster than its serial per-element
        loop: ``-log1p(-U)`` in float64 from the same 53-bit uniforms ``U`` (the same generator calls, so the generator
        ends in the same state), rounded to float32. torch's vectorised ``log1p`` can differ from the kernel's
        ``std::log1p`` in the last float64 bit, which survives the rounding to float32 only at a rounding boundary
        (estimated once in 10^9 draws or fewer; none in the test's 2 x 10^7)."""
        where = self.generator.device if self.generator is not None else probs.device
        if where.type != "cpu" or probs.dtype != torch.float32:
            return torch.empty(probs.shape, dtype=probs.dtype, device=where).exponential_(generator=self.generator)
        uniform = torch.empty(probs.shape, dtype=torch.float64).uniform_(generator=self.generator)  # [N, V]
        return uniform.neg_().log1p_().neg_().to(probs.dtype)  # [N, V]


def decode(step: "LeanStep | ModelStep", logits: torch.Tensor, steps: int, *,
           log_softmax: Callable[[torch.Tensor], torch.Tensor], choose: TokenSampler, forced: torch.Tensor,
           stop_ids: list[int], pad_id: int, module) -> tuple[torch.Tensor, ...]:
    """Decodes up to `steps` tokens per sample, on the model's device.

    Args:
        step: forwards token `t` of every sample (`[N]`) and returns the next logits `[N, V]` ([`LeanStep`],
            [`ModelStep`]); its ``finish()`` is called after the last step (also when the loop raises).
        logits (`torch.FloatTensor` of shape `[N, V]`): the logits after the prompt.
        log_softmax: the policy's log-probs `[N, V]` from logits (temperature, vision tokens excluded).
        choose ([`TokenSampler`]): the next tokens `[N]` from the log-probs `[N, V]`.
        forced (`torch.LongTensor` of shape `[N, S]`): teacher-forced tokens, -1 where the row draws.
        module: the module sampled through (a sharded one makes every process step alike).

    Returns:
        `tuple`: tokens `[N, S]` (the pad token after the end), log-probs `[N, S]` (0 there) and the mask `[N, S]`
        (completion tokens up to and including the end-of-turn token), on the CPU.
    """
    n, device = logits.shape[0], logits.device
    goes_on = torch.ones(logits.shape[-1], dtype=torch.bool, device=device)  # [V]: false at the end-of-turn tokens
    goes_on[stop_ids] = False
    teacher = forced.to(device) if bool((forced >= 0).any()) else None
    alive = torch.ones(n, dtype=torch.bool, device=device)
    drawn, scored, alive_at = [], [], []  # per step: tokens [N], log-probs [N, 1], rows not yet ended [N]
    try:
        for t in range(steps):
            logp = log_softmax(logits)  # [N, V] float32
            chosen = choose(logp)  # [N]
            if teacher is not None:  # teacher-forced rows: the ground truth
                chosen = torch.where(teacher[:, t] >= 0, teacher[:, t], chosen)
            drawn.append(chosen)
            scored.append(logp.gather(1, chosen[:, None]))
            alive_at.append(alive)
            alive = alive & goes_on[chosen]
            if t == steps - 1 or not any_process(bool(alive.any()), module):  # sharded: every process steps alike
                break
            logits = step(chosen, t)
    finally:
        step.finish()
    left = steps - len(drawn)  # steps never decoded: every row had ended
    mask = torch.stack(alive_at, dim=1)  # [N, t + 1]
    tokens = torch.stack(drawn, dim=1).masked_fill_(~mask, pad_id)  # [N, t + 1], the pad token after the end
    log_probs = torch.cat(scored, dim=1).masked_fill_(~mask, 0.0)  # [N, t + 1]
    if left:
        tokens = torch.cat([tokens, tokens.new_full((n, left), pad_id)], dim=1)  # [N, S]
        log_probs = torch.cat([log_probs, log_probs.new_zeros(n, left)], dim=1)
        mask = torch.cat([mask, mask.new_zeros(n, left)], dim=1)
    return tokens.cpu(), log_probs.cpu(), mask.cpu()
