"""Shared by the masked-diffusion algorithms (`cj_grpo`, `diffu_grpo`): the clipped per-step or per-token surrogate
with its k3 KL, and the [`Score`] fields it reads."""

from __future__ import annotations

import torch

from ..losses import clipped_surrogate, k3_kl, masked_mean
from ..types import LossOutput, Score
from ._options import ClipOptions


# the Score fields [`token_step_loss`] reads (``old_token_log_prob`` too with ``ratio_level="token"``)
TOKEN_STEP_READS = frozenset({"log_prob", "mask", "token_log_prob", "token_mask"})


def token_step_loss(new: Score, old_log_prob: torch.Tensor, advantages: torch.Tensor, ref: Score | None, *,
                    clip: ClipOptions, kl_beta: float, ratio_level: str) -> LossOutput:
    """The clipped surrogate (+ k3 KL) of one unit of scored steps or draws, from a masked-diffusion scoring
    [`Score`] (`log_prob` `[n, k]`, `token_log_prob`, `token_mask`, `old_token_log_prob` `[n, k, L]`,
    ``mask`` `[n, k]`); shared by `cj_grpo` and `diffu_grpo`."""
    if new.token_mask is None:
        raise ValueError("This algorithm needs per-token scores (token_log_prob, token_mask): use the mdlm pipeline.")
    step_mask = torch.ones_like(old_log_prob, dtype=torch.bool) if new.mask is None else new.mask  # [n, k]
    tokens = new.token_mask & step_mask[..., None]  # [n, k, L]
    if ratio_level == "token":
        n, k, length = tokens.shape
        log_ratio = (new.token_log_prob - new.old_token_log_prob).reshape(n, k * length)  # [n, k L]
        loss, metrics = clipped_surrogate(log_ratio, advantages, clip.clip_low, clip.high, tokens.reshape(n, k * length))
    else:
        loss, metrics = clipped_surrogate(new.log_prob - old_log_prob, advantages, clip.clip_low, clip.high, step_mask)
    if kl_beta > 0 and ref is not None:
        kl = masked_mean(k3_kl(new.token_log_prob, ref.token_log_prob), tokens)
        loss = loss + kl_beta * kl
        metrics.update(kl=kl.item(), kl_beta=float(kl_beta))
    return LossOutput(loss=loss, metrics=metrics)
