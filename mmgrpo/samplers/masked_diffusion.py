"""Stateless masked-diffusion decoding math: step schedules (fixed and ASS), EOSER, one unmasking step, state rebuild.

A completion of `L` tokens starts fully masked and is decoded in `S` steps; step `s` commits ``k_s`` tokens of its
block, chosen by a confidence (low-confidence remasking: the probability of the sampled token; random remasking: a
uniform draw). The record of a decoding is one integer per completion token, the step that committed it
(``commit_step [N, L]``): the state before step `s` is the prompt plus the tokens with ``commit_step < s``, everything
else masked ([`rebuild_state`]), so replay needs no copy of the intermediate states.

References: LLaDA's low-confidence remasking and semi-autoregressive blocks (https://arxiv.org/abs/2502.09992);
EOSER and ASS from CJ-GRPO (https://arxiv.org/abs/2509.23924).

Inputs that cannot decode (no tokens, a step that commits none, block lengths that do not divide the completion, a
negative or overflowing temperature...) are refused with a `ValueError` naming the argument, never decoded into a
NaN probability or a completion that stays masked.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


def ass_sizes(length: int) -> list[int]:
    """ASS (ascending step size): ``2^i`` tokens at step `i`, the last step taking the remainder, so `length` tokens
    take ``ceil(log2(length + 1))`` steps (e.g. 8 -> ``[1, 2, 4, 1]``, 7 -> ``[1, 2, 4]``)."""
    if length < 1:
        raise ValueError(f"ASS needs at least one token to decode, got length {length}.")
    steps = math.ceil(math.log2(length + 1))
    sizes = [2**i for i in range(steps - 1)]
    return sizes + [length - sum(sizes)]


def linear_sizes(length: int, steps: int) -> list[int]:
    """LLaDA's fixed schedule: ``length // steps`` tokens per step, one more in the first ``length % steps``."""
    if not 1 <= steps <= length:
        raise ValueError(f"A fixed schedule of {steps} steps cannot decode {length} tokens: use 1..{length} steps.")
    base, extra = divmod(length, steps)
    return [base + (1 if i < extra else 0) for i in range(steps)]


@dataclass
class DecodingSchedule:
    """Which block each step decodes and how many tokens it commits.

    Args:
        block_of_step (`list[int]`): block index of every step, length `S`.
        tokens_per_step (`list[int]`): tokens committed by every step, length `S`; each block's steps sum to its length.
        block_length (`int`): tokens per block (the last block of a completion is this long too).
    """

    block_of_step: list[int]
    tokens_per_step: list[int]
    block_length: int

    @property
    def num_steps(self) -> int:
        return len(self.tokens_per_step)


def make_schedule(gen_length: int, block_length: int, steps_per_block: int, kind: str) -> DecodingSchedule:
    """The decoding schedule of a `gen_length`-token completion in blocks of `block_length` (``== gen_length``: full
    diffusion), with ``kind = "fixed"`` (`steps_per_block` steps each, [`linear_sizes`]) or ``"ass"`` ([`ass_sizes`]
    in each block; `steps_per_block` ignored)."""
    if gen_length < 1 or block_length < 1 or gen_length % block_length:
        raise ValueError(
            f"gen_length {gen_length} must be a positive multiple of block_length {block_length} (use "
            f"block_length = gen_length for full-diffusion decoding)."
        )
    if kind == "ass":
        sizes = ass_sizes(block_length)
    elif kind == "fixed":
        sizes = linear_sizes(block_length, steps_per_block)
    else:
        raise ValueError(f"schedule must be 'fixed' or 'ass', got {kind!r}.")
    blocks = gen_length // block_length
    return DecodingSchedule(
        block_of_step=[b for b in range(blocks) for _ in sizes], tokens_per_step=sizes * blocks, block_length=block_length
    )


def eoser_gamma(step: int, num_steps: int, gamma_min: float, gamma_max: float, kind: str) -> float:
    """EOSER's factor on the confidence of EOS candidates at global step `step` of `num_steps`: rising from
    `gamma_min` to `gamma_max`, linearly (``kind="linear"``: ``i / (S - 1)``) or with the fraction decoded by ASS
    after the step (``kind="power"``: ``(2^(i+1) - 1) / 2^S``)."""
    if not 0 <= step < num_steps:
        raise ValueError(f"EOSER's step must be in [0, num_steps) = [0, {num_steps}), got {step}.")
    if not all(math.isfinite(g) and g >= 0 for g in (gamma_min, gamma_max)):
        raise ValueError(f"EOSER's gamma_min and gamma_max must be finite and >= 0, got {gamma_min} and {gamma_max}.")
    if kind == "linear":
        fraction = step / (num_steps - 1) if num_steps > 1 else 1.0
    elif kind == "power":
        fraction = (2 ** (step + 1) - 1) / 2**num_steps
    else:
        raise ValueError(f"EOSER kind must be 'linear' or 'power', got {kind!r}.")
    return gamma_min + (gamma_max - gamma_min) * fraction


def token_log_probs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Log-probabilities `[n, T]` of `tokens` `[n, T]` under ``softmax(logits / temperature)``, `logits` `[n, T, V]`
    (float32 inside; a temperature of 0, greedy decoding, scores at temperature 1).

    Raises:
        `ValueError`: when `temperature` is negative or not finite, or the scaled logits hold NaN or +inf (or a
        position has no finite logit).
    """
    scaled = _scaled(logits, temperature)  # [n, T, V]
    return torch.log_softmax(scaled, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)  # [n, T]


def _scaled(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """``logits / temperature`` in float32 (temperature 0: unscaled), refusing what softmax would turn into NaN."""
    if not (math.isfinite(temperature) and temperature >= 0):
        raise ValueError(f"temperature must be a finite number >= 0 (0: greedy decoding), got {temperature}.")
    scaled = logits.float() / (temperature if temperature > 0 else 1.0)
    if not bool(torch.isfinite(scaled.amax(dim=-1)).all()):  # NaN or +inf, or no finite logit (-inf: ruled out)
        raise ValueError(
            f"logits / temperature holds NaN or +inf (or a position has no finite logit): temperature {temperature} "
            "is too small for these logits (use 0 for greedy decoding), or the model returned NaN / inf logits."
        )
    return scaled


@dataclass
class UnmaskStep:
    """Result of [`unmask_step`]: the new state `[n, T]`, which positions it committed `[n, T]` (bool), and the
    log-probability `[n, T]` of every sampled candidate (meaningful where `committed`)."""

    state: torch.Tensor
    committed: torch.Tensor
    log_prob: torch.Tensor


def unmask_step(
    logits: torch.Tensor,
    state: torch.Tensor,
    candidates: torch.Tensor,
    k: int,
    *,
    temperature: float,
    remasking: str,
    eos_ids: list[int] | tuple[int, ...] = (),
    eos_gamma: float = 1.0,
    generator: torch.Generator | None = None,
) -> UnmaskStep:
    """One masked-diffusion decoding step.

    Args:
        logits (`torch.FloatTensor` of shape `[n, T, V]`): the model's (aligned) logits on `state`.
        state (`torch.LongTensor` of shape `[n, T]`): the current tokens (masked positions hold the mask id).
        candidates (`torch.BoolTensor` of shape `[n, T]`): positions that may be committed (masked, in the block).
        k (`int`): tokens to commit per row (fewer when a row has fewer candidates).
        temperature (`float`): sampling temperature (0: greedy).
        remasking (`str`): ``"low_confidence"`` (commit the `k` most probable samples, probability without
            temperature, as LLaDA) or ``"random"`` (a uniform confidence).
        eos_ids (`list[int]`): token ids whose confidence EOSER scales by `eos_gamma` (selection only: the sampled
            tokens and their log-probabilities are unchanged).
        eos_gamma (`float`): EOSER's factor at this step (1: off).
        generator (`torch.Generator`, *optional*): on the logits' device; draws the tokens and random confidences.

    Raises:
        `ValueError`: for ``k < 1`` (the step would commit nothing), an unknown `remasking`, a negative or non-finite
        `eos_gamma`, and the temperatures [`token_log_probs`] refuses.
    """
    if k < 1:
        raise ValueError(f"k, the tokens a step commits, must be >= 1 (0 would leave the completion masked), got {k}.")
    if remasking not in ("low_confidence", "random"):
        raise ValueError(f"remasking must be 'low_confidence' or 'random', got {remasking!r}.")
    if not (math.isfinite(eos_gamma) and eos_gamma >= 0):
        raise ValueError(f"eos_gamma must be finite and >= 0 (1: EOSER off), got {eos_gamma}.")
    scaled = _scaled(logits, temperature)  # [n, T, V]
    logits = logits.float()  # [n, T, V]
    if temperature > 0:
        probs = torch.softmax(scaled, dim=-1)  # [n, T, V]
        flat = probs[candidates]  # [c, V]
        sampled = torch.argmax(logits, dim=-1)  # [n, T] placeholder outside the candidates
        if flat.shape[0]:
            sampled[candidates] = torch.multinomial(flat, 1, generator=generator).squeeze(-1)
    else:
        sampled = torch.argmax(logits, dim=-1)  # [n, T]
    if remasking == "low_confidence":
        confidence = torch.softmax(logits, dim=-1).gather(-1, sampled.unsqueeze(-1)).squeeze(-1)  # [n, T]
    else:  # random
        confidence = torch.rand(state.shape, generator=generator, device=state.device)  # [n, T]
    if eos_ids and eos_gamma != 1.0:
        is_eos = torch.isin(sampled, torch.as_tensor(list(eos_ids), device=sampled.device))
        confidence = torch.where(is_eos, confidence * eos_gamma, confidence)
    confidence = confidence.masked_fill(~candidates, -math.inf)
    count = torch.clamp(candidates.sum(dim=1), max=k)  # [n]
    order = torch.argsort(confidence, dim=1, descending=True, stable=True)  # [n, T]
    rank = torch.empty_like(order).scatter_(1, order, torch.arange(order.shape[1], device=order.device).expand_as(order))
    committed = (rank < count[:, None]) & candidates  # [n, T]
    return UnmaskStep(
        state=torch.where(committed, sampled, state),
        committed=committed,
        log_prob=torch.log_softmax(scaled, dim=-1).gather(-1, sampled.unsqueeze(-1)).squeeze(-1),  # [n, T]
    )


def rebuild_state(
    prompt_ids: torch.Tensor, completion: torch.Tensor, commit_step: torch.Tensor, step: int, mask_id: int
) -> torch.Tensor:
    """The exact state before decoding step `step`: `prompt_ids` `[n, P]` then the completion `[n, L]` with every
    token whose ``commit_step`` `[n, L]` is not below `step` replaced by `mask_id`; returns `[n, P + L]`."""
    visible = torch.where(commit_step < step, completion, torch.full_like(completion, mask_id))  # [n, L]
    return torch.cat([prompt_ids, visible], dim=1)
