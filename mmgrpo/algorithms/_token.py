"""Pieces shared by the token-level algorithms (`grpo`, `dr_grpo`, `dapo`, `gspo`, `sapo`, `reg_grpo`): the sampling
plan of a token policy, their traits, loss aggregation over masked tokens, the clipped token loss, the KL term (k3,
from `mmgrpo.losses`) and the metrics every one of them logs. Their options (clip, KL weight and schedule, advantages)
are the shared records of [`mmgrpo.algorithms._options`].

They assume nothing about the modality: a "token" is any scored decision of a pipeline whose ``log_prob`` returns
``log_prob`` and ``mask`` `[n, T]` (an autoregressive VLM's completion tokens, a masked-diffusion LM's tokens).
Not a plugin: the name starts with an underscore and it defines no ``PLUGIN``.
"""

from __future__ import annotations

from typing import Literal

import torch

from ..losses import clipped_objective, k3_kl
from ..plans import TokenPlan
from ..types import AlgorithmTraits, Score
from ._options import ClipOptions, KLWeight

Aggregation = Literal["sequence_mean", "token_mean", "fixed_length"]
TOKEN_READS = frozenset({"log_prob", "mask"})  # the Score fields every token loss reads (mask: the scored tokens)


def token_plan(num_steps: int, ground_truth_member: bool = False) -> TokenPlan:
    """Every decision samples and the whole completion is one trained unit, ``[[0, ..., T - 1]]``: the trainer
    scores all tokens of a minibatch in one forward (the ratio of a token needs the tokens before it). A token plan
    runs on the pipelines that speak the ``"token"`` family (`qwen_vl`; `mdlm`, one decoding step per decision).
    With `ground_truth_member`, member 0 of each group decodes its prompt's ground truth (see `GROUND_TRUTH_DOC`)."""
    steps = list(range(num_steps))
    return TokenPlan(num_steps=num_steps, train_units=[steps], ground_truth_member=ground_truth_member)


def schedule(self, num_steps: int, generator: torch.Generator | None = None) -> TokenPlan:
    """The protocol's ``schedule`` of a token algorithm, [`token_plan`] with its ``ground_truth_member`` option; each
    token algorithm takes it into its class by name (the generator is not used: the plan draws nothing)."""
    return token_plan(num_steps, self.config.ground_truth_member)


def token_traits(config, kl: KLWeight, reads: frozenset[str] = TOKEN_READS, **more) -> AlgorithmTraits:
    """The traits of a token algorithm with options `config` (its embedded ``advantage`` record and
    ``ground_truth_member``) and KL weight `kl`: it reads the reference when the KL weight is ever above 0; `more`
    adds its own (e.g. ``update_mean``, ``rollout_correction``)."""
    return AlgorithmTraits(reads=reads, needs_reference=kl.ever_positive,
                           group_local_advantages=config.advantage.group_local,
                           ground_truth_member=config.ground_truth_member, **more)


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
    """``loss + beta * aggregate(k3 KL)`` when `beta` > 0 and a reference score is given; logs ``kl`` and the weight
    used, ``kl_beta`` (it moves under a KL schedule)."""
    if beta <= 0 or ref is None:
        return loss
    kl = aggregate(k3_kl(new.log_prob, ref.log_prob), mask, mode)
    metrics["kl"] = kl.item()
    metrics["kl_beta"] = float(beta)
    return loss + beta * kl


def clipped_token_loss(new: Score, old_log_prob: torch.Tensor, advantages: torch.Tensor, ref: Score | None,
                       clip: ClipOptions, beta: float, mode: Aggregation,
                       mask: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
    """The clipped per-token surrogate aggregated by `mode`, plus `beta` times the k3 KL aggregated alike, and its
    metrics ([`ratio_metrics`], ``kl``). With ``new.is_weight`` (the rollout correction's importance weights), each
    token's surrogate is multiplied by its weight before the aggregation, the KL term not (TRL's rule).

    Args:
        new ([`Score`]): ``log_prob`` `[n, T]` with gradients and ``mask`` `[n, T]` (scored tokens).
        old_log_prob (`torch.FloatTensor` of shape `[n, T]`): log-probs recorded at sampling.
        advantages (`torch.FloatTensor` of shape `[n]`).
        ref ([`Score`], *optional*): the reference policy's ``log_prob`` `[n, T]`.
        mask (`torch.FloatTensor` of shape `[n, T]`, *optional*): the tokens to train (default: the scored tokens).
    """
    mask = token_mask(new, new.log_prob) if mask is None else mask  # [n, T]
    log_ratio = new.log_prob - old_log_prob  # [n, T]
    per_token, clipped = clipped_objective(log_ratio, advantages, clip.clip_low, clip.high)
    if new.is_weight is not None:
        per_token = per_token * new.is_weight.detach()  # [n, T]
    policy_loss = aggregate(per_token, mask, mode)
    metrics = ratio_metrics(log_ratio, mask, clipped, policy_loss)
    return add_kl(policy_loss, metrics, new, ref, mask, beta, mode), metrics


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


# The Args entry of ``ground_truth_member``, appended to each token algorithm's Config docstring.
GROUND_TRUTH_DOC = """
        ground_truth_member (`bool`): TempSamp-R1's off-policy member: member 0 of each group is not sampled but
            teacher-forced through its prompt's ground-truth completion, the data's ``metadata["completion"]`` text
            (end-of-turn appended), so a group of ``train.group_size`` G + 1 holds G samples and the answer. It is
            rewarded, enters the group statistics (and the advantage transform) and is trained like the others; its
            "old" log-probs are the sampling policy's on those tokens, so its ratio starts at 1 (no importance weight
            for the off-policy source). Needs a pipeline that implements it (`qwen_vl`). The trainer then also logs
            ``reward/sampled_mean``, the reward of the sampled members alone.
"""

# The Args entry of the rollout correction options, appended to the Config docstring of each token algorithm that
# embeds them (grpo, dr_grpo, dapo).
CORRECTION_DOC = """        rollout_correction (`str`), rollout_is_clip_max (`float`), rollout_is_clip_min (`float`),
            rollout_rs_threshold (`float`), rollout_rs_threshold_lower (`float`): what the trainer does with a rollout
            whose engine's log-probs differ from its own forward (``"recompute"`` by default: the old log-probs
            recomputed by the trainer; TRL's truncated / masked importance sampling per token or sequence; verl's
            rejection): see [`~mmgrpo.algorithms._options.RolloutCorrectionOptions`]. The local engine needs none.
"""
