"""Pieces shared by the token-level algorithms (`grpo`, `dr_grpo`, `dapo`, `gspo`, `sapo`): the sampling plan of a
token policy, loss aggregation over masked tokens, the KL term (k3, from `mmgrpo.losses`), the checks of their
options and the metrics every one of them logs.

They assume nothing about the modality: a "token" is any scored decision of a pipeline whose ``log_prob`` returns
``log_prob`` and ``mask`` `[n, T]` (an autoregressive VLM's completion tokens, a masked-diffusion LM's tokens).
Not a plugin: the name starts with an underscore and it defines no ``PLUGIN``.
"""

from __future__ import annotations

from typing import Literal

import torch

from ..losses import k3_kl
from ..types import Score, TokenPlan
from ..validation import check_range

Aggregation = Literal["sequence_mean", "token_mean", "fixed_length"]
TOKEN_READS = frozenset({"log_prob", "mask"})  # the Score fields every token loss reads (mask: the scored tokens)


def token_plan(num_steps: int) -> TokenPlan:
    """Every decision samples and the whole completion is one trained unit, ``[[0, ..., T - 1]]``: the trainer
    scores all tokens of a minibatch in one forward (the ratio of a token needs the tokens before it). A token plan
    runs on the pipelines that speak the ``"token"`` family (`qwen_vl`; `mdlm`, one decoding step per decision)."""
    steps = list(range(num_steps))
    return TokenPlan(num_steps=num_steps, train_units=[steps])


def token_mask(new: Score, like: torch.Tensor) -> torch.Tensor:
    """The scored-token mask `[n, T]` (float) from the policy's output; all ones when the policy gives none."""
    mask = new.mask
    return torch.ones_like(like) if mask is None else mask.to(like.dtype)


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, mode: Aggregation) -> torch.Tensor:
    """Reduces a per-token loss `[n, T]` to a scalar over the tokens where `mask` `[n, T]` is 1.

    - ``"sequence_mean"`` (GRPO): mean over each sequence's tokens, then mean over the `n` sequences.
    - ``"token_mean"`` (DAPO): sum over all tokens / number of tokens (every token weighs the same).
    - ``"fixed_length"`` (Dr. GRPO): sum over all tokens / (n * T), `T` the fixed maximum completion length, so the
      weight of a token does not depend on its sequence's length.

    An all-zero mask gives 0 with a zero gradient (connected to the graph).
    """
    masked = per_token * mask
    if mode == "sequence_mean":
        lengths = mask.sum(dim=1)  # [n]
        per_sequence = masked.sum(dim=1) / lengths.clamp_min(1.0)  # [n]
        return per_sequence.mean()
    if mode == "token_mean":
        return masked.sum() / mask.sum().clamp_min(1.0)
    if mode == "fixed_length":
        return masked.sum() / max(1, per_token.numel())
    raise ValueError(f"Unknown aggregation {mode!r}; choose 'sequence_mean', 'token_mean' or 'fixed_length'.")


def add_kl(loss: torch.Tensor, metrics: dict, new: Score, ref: Score | None, mask: torch.Tensor, beta: float,
           mode: Aggregation) -> torch.Tensor:
    """``loss + beta * aggregate(k3 KL)`` when `beta` > 0 and a reference score is given; logs ``kl``."""
    if beta <= 0 or ref is None:
        return loss
    kl = aggregate(k3_kl(new.log_prob, ref.log_prob), mask, mode)
    metrics["kl"] = kl.item()
    return loss + beta * kl


def ratio_metrics(log_ratio: torch.Tensor, mask: torch.Tensor, clipped: torch.Tensor, policy_loss: torch.Tensor) -> dict:
    """``policy_loss``, ``ratio_mean``, ``clip_frac`` and ``approx_kl`` (``0.5 * log_ratio^2``) over the masked
    tokens; the on-policy values when no token is scored."""
    with torch.no_grad():
        count = mask.sum()
        if count == 0:
            return {"policy_loss": 0.0, "ratio_mean": 1.0, "clip_frac": 0.0, "approx_kl": 0.0}
        return {
            "policy_loss": policy_loss.item(),
            "ratio_mean": ((torch.exp(log_ratio) * mask).sum() / count).item(),
            "clip_frac": ((clipped.float() * mask).sum() / count).item(),
            "approx_kl": ((0.5 * log_ratio**2 * mask).sum() / count).item(),
        }


def check_options(clip_low: float, clip_high: float, kl_beta: float) -> None:
    """The checks every token algorithm's Config shares: clip ranges and the KL weight."""
    check_range("clip_low", clip_low, 0, 1, low_open=True, high_open=True, fix="the ratio is clipped at 1 - clip_low")
    check_range("clip_high", clip_high, 0, low_open=True)
    check_range("kl_beta", kl_beta, 0, fix="0 turns the KL term off")
