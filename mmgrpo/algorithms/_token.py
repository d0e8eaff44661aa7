"""Pieces shared by the token-level algorithms (`grpo`, `dr_grpo`, `dapo`, `gspo`, `sapo`, `reg_grpo`): the sampling
plan of a token policy, loss aggregation over masked tokens, the KL term (k3, from `mmgrpo.losses`) and its weight's
schedule over the optimizer updates ([`KLWeight`], OThink-MR1's dynamic KL), the reward transform before the group
statistics (TempSamp-R1's soft advantage), the checks of their options and the metrics every one of them logs.

They assume nothing about the modality: a "token" is any scored decision of a pipeline whose ``log_prob`` returns
``log_prob`` and ``mask`` `[n, T]` (an autoregressive VLM's completion tokens, a masked-diffusion LM's tokens).
Not a plugin: the name starts with an underscore and it defines no ``PLUGIN``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

from ..advantages import tempsamp_soft
from ..losses import k3_kl
from ..types import Score
from ..plans import TokenPlan
from ._limits import CLIP_LIMIT, KL_BETA_LIMIT, SCALE_LIMIT, UPDATES_LIMIT
from ..validation import ConfigError, check_range

Aggregation = Literal["sequence_mean", "token_mean", "fixed_length"]
KLSchedule = Literal["constant", "linear", "cosine"]
AdvantageTransform = Literal["none", "tempsamp_soft"]
KL_SCHEDULES = ("constant", "linear", "cosine")
ADVANTAGE_TRANSFORMS = ("none", "tempsamp_soft")
TOKEN_READS = frozenset({"log_prob", "mask"})  # the Score fields every token loss reads (mask: the scored tokens)


def token_plan(num_steps: int, ground_truth_member: bool = False) -> TokenPlan:
    """Every decision samples and the whole completion is one trained unit, ``[[0, ..., T - 1]]``: the trainer
    scores all tokens of a minibatch in one forward (the ratio of a token needs the tokens before it). A token plan
    runs on the pipelines that speak the ``"token"`` family (`qwen_vl`; `mdlm`, one decoding step per decision).
    With `ground_truth_member`, member 0 of each group decodes its prompt's ground truth (see `SHARED_DOCS`)."""
    steps = list(range(num_steps))
    return TokenPlan(num_steps=num_steps, train_units=[steps], ground_truth_member=ground_truth_member)


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


def kl_weight(schedule: str, start: float, end: float | None, steps: int, update: int) -> float:
    """The KL weight after `update` optimizer updates (OThink-MR1's GRPO-D: a low weight early lets the policy
    explore, a higher one later holds it near the reference; the schedule is ours, written out here).

    With ``p = min(1, update / steps)``: ``"constant"`` gives `start`; ``"linear"`` gives
    ``start + (end - start) * p``; ``"cosine"`` gives ``start + (end - start) * (1 - cos(pi * p)) / 2`` (flat at both
    ends). From update `steps` on, the weight stays `end`.
    """
    if schedule == "constant":
        return start
    progress = min(1.0, update / steps)
    shape = progress if schedule == "linear" else (1 - math.cos(math.pi * progress)) / 2
    return start + (end - start) * shape


@dataclass
class KLWeight:
    """A token algorithm's KL weight and the number of optimizer updates taken (its whole state), see [`kl_weight`].

    Under a schedule other than ``"constant"`` the algorithm declares ``has_state`` and ``after_update``: the trainer
    calls [`step`] after every optimizer update it takes (a skipped update does not count, as for the learning-rate
    schedule) and checkpoints [`state_dict`], so a resumed run continues the schedule exactly.
    """

    schedule: str
    start: float
    end: float | None
    steps: int
    updates: int = 0

    @classmethod
    def of(cls, config) -> "KLWeight":
        return cls(config.kl_schedule, config.kl_beta, config.kl_beta_end, config.kl_warmup_steps)

    @property
    def dynamic(self) -> bool:
        return self.schedule != "constant"

    @property
    def ever_positive(self) -> bool:
        """Whether the weight is ever above 0 (the reference policy is then scored)."""
        return self.start > 0 or (self.dynamic and self.end > 0)

    def __call__(self) -> float:
        return kl_weight(self.schedule, self.start, self.end, self.steps, self.updates)

    def step(self, policy=None) -> None:
        self.updates += 1

    def state_dict(self) -> dict:
        return {"kl_updates": self.updates}

    def load_state_dict(self, state: dict) -> None:
        self.updates = int(state["kl_updates"])


def attach_kl_members(algorithm, kl: KLWeight) -> None:
    """Gives `algorithm` the optional members a KL schedule needs, ``after_update(policy)``, ``state_dict()`` and
    ``load_state_dict(state)``, exactly when the schedule is dynamic (its traits declare them then)."""
    if kl.dynamic:
        algorithm.after_update = kl.step
        algorithm.state_dict, algorithm.load_state_dict = kl.state_dict, kl.load_state_dict


def shaped_scores(scores: torch.Tensor, config) -> torch.Tensor:
    """The rewards `[N]` the group statistics see: TempSamp-R1's soft transform when ``advantage_transform`` is
    ``"tempsamp_soft"`` (see [`~mmgrpo.advantages.tempsamp_soft`]), else unchanged."""
    if config.advantage_transform == "tempsamp_soft":
        return tempsamp_soft(scores, config.soft_threshold, config.soft_alpha_high, config.soft_alpha_low)
    return scores


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
    """The checks every clipped token algorithm's Config shares: clip ranges and the KL weight."""
    check_range("clip_low", clip_low, 0, 1, low_open=True, high_open=True, fix="the ratio is clipped at 1 - clip_low")
    check_range("clip_high", clip_high, 0, CLIP_LIMIT, low_open=True, fix="the ratio is clipped at 1 + clip_high")
    check_range("kl_beta", kl_beta, 0, KL_BETA_LIMIT, fix="0 turns the KL term off")


def check_shared(config) -> None:
    """The checks of the options every token algorithm's Config has (documented in [`SHARED_DOCS`]): the KL weight and
    its schedule, the advantage transform and its parameters."""
    check_range("kl_beta", config.kl_beta, 0, KL_BETA_LIMIT, fix="0 turns the KL term off")
    if config.kl_schedule not in KL_SCHEDULES:
        raise ConfigError(f"kl_schedule must be one of {KL_SCHEDULES}, got {config.kl_schedule!r}.")
    if config.kl_schedule == "constant":
        if config.kl_beta_end is not None or config.kl_warmup_steps != 0:
            raise ConfigError(
                f"kl_beta_end={config.kl_beta_end!r} / kl_warmup_steps={config.kl_warmup_steps!r} apply only to a KL "
                f"schedule: set kl_schedule to 'linear' or 'cosine', or leave them out (kl_beta stays constant)."
            )
    else:
        if config.kl_beta_end is None:
            raise ConfigError(f"kl_schedule={config.kl_schedule!r} needs kl_beta_end, the KL weight it reaches after "
                              f"kl_warmup_steps optimizer updates (kl_beta is the weight at the start).")
        check_range("kl_beta_end", config.kl_beta_end, 0, KL_BETA_LIMIT,
                    fix="the KL weight reached at the end of the schedule")
        check_range("kl_warmup_steps", config.kl_warmup_steps, 1, UPDATES_LIMIT,
                    fix="the number of optimizer updates over which the KL weight moves from kl_beta to kl_beta_end")
    if config.advantage_transform not in ADVANTAGE_TRANSFORMS:
        raise ConfigError(f"advantage_transform must be one of {ADVANTAGE_TRANSFORMS}, got "
                          f"{config.advantage_transform!r}.")
    check_range("soft_threshold", config.soft_threshold, -SCALE_LIMIT, SCALE_LIMIT, fix="a reward level, e.g. 0.8")
    check_range("soft_alpha_high", config.soft_alpha_high, 0, SCALE_LIMIT,
                fix="0 makes every reward above soft_threshold equal")
    check_range("soft_alpha_low", config.soft_alpha_low, 0, SCALE_LIMIT, low_open=True, fix="TempSamp-R1 uses 1")


# The Args entries of the options in `check_shared`, appended to each token algorithm's Config docstring.
SHARED_DOCS = """
        kl_schedule (`str`): how the KL weight moves over the optimizer updates taken (OThink-MR1's dynamic KL,
            GRPO-D: low early to explore, higher later to hold the policy near the reference). ``"constant"``: always
            `kl_beta`. ``"linear"`` / ``"cosine"``: from `kl_beta` at the first update to `kl_beta_end` after
            `kl_warmup_steps` updates, then constant: with ``p = min(1, u / kl_warmup_steps)`` after `u` updates, the
            weight is ``kl_beta + (kl_beta_end - kl_beta) * w(p)``, ``w(p) = p`` or ``(1 - cos(pi p)) / 2``. The update
            count is checkpointed (a resumed run continues the schedule).
        kl_beta_end (`float`, *optional*): the KL weight a ``"linear"`` / ``"cosine"`` schedule reaches (required by
            them, refused under ``"constant"``).
        kl_warmup_steps (`int`): the optimizer updates over which the schedule moves (one trainer step takes
            ``inner_epochs * updates_per_step`` of them); 0 under ``"constant"``.
        advantage_transform (`str`): ``"none"``, or ``"tempsamp_soft"``: TempSamp-R1's asymmetric soft transform of
            each reward before the group statistics, ``tau + a_high * log(r - tau + 1)`` for ``r >= tau`` (rewards
            above the threshold nearly flattened) and ``tau - (exp(a_low * (tau - r)) - 1) / (exp(a_low) - 1)`` below
            it (a growing penalty the further below), with ``tau`` = `soft_threshold`.
        soft_threshold (`float`): ``tau`` of the soft transform (TempSamp-R1: 0.8 on a temporal IoU).
        soft_alpha_high (`float`): ``a_high``, the slope of the log above ``tau`` (0.01).
        soft_alpha_low (`float`): ``a_low`` (> 0), the curvature of the exponential below ``tau`` (1.0).
        ground_truth_member (`bool`): TempSamp-R1's off-policy member: member 0 of each group is not sampled but
            teacher-forced through its prompt's ground-truth completion, the data's ``metadata["completion"]`` text
            (end-of-turn appended), so a group of ``train.group_size`` G + 1 holds G samples and the answer. It is
            rewarded, enters the group statistics (and the advantage transform) and is trained like the others; its
            "old" log-probs are the sampling policy's on those tokens, so its ratio starts at 1 (no importance weight
            for the off-policy source). Needs a pipeline that implements it (`qwen_vl`). The trainer then also logs
            ``reward/sampled_mean``, the reward of the sampled members alone.
"""
