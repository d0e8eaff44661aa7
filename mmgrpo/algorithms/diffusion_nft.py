"""DiffusionNFT: online diffusion RL on the forward process, contrasting implicit positive and negative policies.

Paper: https://arxiv.org/abs/2509.16117 (code: NVlabs/DiffusionNFT, ``scripts/train_nft_sd3.py``). Rollouts use a
deterministic solver (``solver: dpm`` or ``flow``) and record no likelihood; only the final samples ``x0`` are kept.
Each sample is noised afresh, ``x_t = (1 - t) x0 + t eps`` with its own ``eps`` (``FlowPlan.likelihood_noise =
"sample"``), at noise levels of the sampling schedule, and the loss reads the trained velocity ``v``, the old model's
``v_old`` at the same point (``traits.old_score``) and the reference's ``v_ref``:

    A   = clamp(advantage, -A_max, A_max)                        (A_max = adv_clip_max)
    r   = clamp(A / (2 A_max) + 1/2, 0, 1)                       (optimality probability)
    v+  = beta v + (1 - beta) v_old,      v- = (1 + beta) v_old - beta v
    x0± = x_t - t v±,   L± = mean((x0± - x0)^2 / w±),   w± = stopgrad(max(mean|x0± - x0|, 1e-5))  (adaptive)
    loss = mean_i((r L+ + (1 - r) L-) / beta * A_max)  +  kl_beta * mean ||v - v_ref||^2

(``x0± - x0 = t (target - v±)`` with ``target = eps - x0``, which the likelihood returns with ``t`` as ``sigma``.) A
high reward pulls the positive policy towards the sample, a low one the negative policy; with ``v_old = v`` both equal
``v`` and the gradient of the policy term is ``beta`` times ``(2r - 1)`` the (weighted) flow-matching gradient.

The old model is a slowly updated EMA of the trained weights, ``old <- d old + (1 - d) theta``, held by the algorithm
(like DGPO's fast EMA; it only needs `trainable_parameters`, so it works unchanged for every flow pipeline), stepped
once per training step (the authors' rollout epoch, after its updates) with the authors' decay after ``u`` optimizer
updates in all (``decay_type``): 0: ``0``; 1: ``min(0.001 u, 0.5)``; 2: ``0`` for ``u < 75``, then
``min(0.0075 (u - 75), 0.999)``, the authors' ``return_decay(global_step)``, ``global_step`` their optimizer updates
(here the KL weight's update count, ``kl.updates``). The step is owed at the end of the training step
([`~DiffusionNFT.after_step`]) and taken before the old model is next read (the weights do not change in between).

Differences from the authors' code:

- Rollouts sample the current weights; the authors sample the old (EMA) adapter. With ``decay_type`` 1 the old model
  lags by at most half an update early on, so the samples differ little; the loss is the authors'.
- The trained noise levels: the authors draw per sample a permutation of the ``T`` sampling timesteps and train the
  first ``int(0.99 T)`` (all but one, per sample). Here every sample of a step trains the same
  ``int(level_fraction * T)`` levels, a random subset drawn per step (all but one at the default 0.99): the same levels
  in expectation, with one dropped level shared by the batch instead of one per sample.
- ``solver: dpm`` is diffusers' DPM-Solver++ (2nd order, flow sigmas with ``flow_shift``); the authors run their own
  2nd-order DPM-Solver on the pipeline's scheduler sigmas (``solver: flow`` uses those sigmas, with Euler steps).
- The authors evaluate with a second EMA of the weights (decay 0.9); mmgrpo evaluates the trained weights.
- Advantages: the shared options with the authors' per-prompt tracker's rule (group mean, the whole batch's population
  std + 1e-4, ``global_std: True``), computed on one rollout batch (the authors' tracker pools a prompt's samples over
  the epoch, the same when each prompt appears in one group per epoch).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from ..ema import ParameterEMA
from ..plans import FlowPlan
from ..types import AlgorithmTraits, LossOutput, Score
from ..validation import ConfigError, check_fields, check_range, embedded
from ._limits import SCALE_LIMIT, SHIFT_LIMIT
from . import _options
from ._flow_common import likelihood_plan
from ._options import AdvantageOptions, KLOptions, KLWeight

# decay_type -> (flat updates, rate per update, ceiling) of the old model's EMA decay (the authors' `return_decay`)
DECAY_TYPES = {0: (0, 0.0, 0.0), 1: (0, 0.001, 0.5), 2: (75, 0.0075, 0.999)}


def nft_decay(updates: int, decay_type: int) -> float:
    """The authors' ``return_decay(step, decay_type)``: the old model's EMA decay after `updates` optimizer updates,
    ``0`` during the flat phase, then ``min(rate * (updates - flat), ceiling)``."""
    flat, rate, ceiling = DECAY_TYPES[decay_type]
    return 0.0 if updates < flat else min((updates - flat) * rate, ceiling)


@dataclass
class DiffusionNFTConfig:
    """Options of [`DiffusionNFT`]: its own and the shared KL and advantage options (written flat, see
    ``mmgrpo show diffusion_nft``), with the authors' defaults (``config/nft.py``: GenEval / PickScore).

    Args:
        beta (`float`): the mixing strength of the implicit policies, ``v+ = beta v + (1 - beta) v_old`` (the authors'
            ``config.beta``: 1.0; 0.1 for OCR and multi-reward).
        adv_mode (`str`): the authors' ``train.adv_mode``: ``"all"`` (both signs), ``"positive_only"`` /
            ``"negative_only"`` (the other sign clamped to 0), ``"one_only"`` (1 where the advantage is positive, else
            0), ``"binary"`` (its sign).
        decay_type (`int`): the old model's EMA decay schedule over optimizer updates ``u``: 0: 0 (the old model is the
            previous weights); 1: ``min(0.001 u, 0.5)`` (the authors' default); 2: 0 for 75 updates, then
            ``min(0.0075 (u - 75), 0.999)`` (their OCR config).
        kl_beta (`float`): weight of the velocity KL ``mean ||v - v_ref||^2`` to the reference (the authors'
            ``train.beta``: 1e-4).
        adv_clip_max (`float`): ``A_max``: the advantages are clamped to ``[-A_max, A_max]``, mapped to ``r`` by it and
            the loss is scaled by it (the authors' ``adv_clip_max``, 5); required here.
        level_fraction (`float`): the share of the sampling noise levels trained per step, ``int(level_fraction * T)``
            of the ``T`` levels, a random subset shared by the step's samples (the authors' ``timestep_fraction`` 0.99
            draws it per sample; see the module docstring).
        solver (`str`): the rollouts' deterministic sampler, in `FlowPlan.solver`'s words: ``"dpm"`` (DPM-Solver++
            with flow sigmas and `flow_shift`, as DGPO) or ``"flow"`` (the pipeline's Euler ODE on its own sigmas).
        flow_shift (`float`): ``flow_shift`` of the DPM-Solver++ noise levels (unused by ``"flow"``).
    """

    beta: float = 1.0
    adv_mode: Literal["all", "positive_only", "negative_only", "one_only", "binary"] = "all"
    decay_type: Literal[0, 1, 2] = 1
    kl: KLOptions = embedded(KLOptions, kl_beta=1e-4)
    advantage: AdvantageOptions = embedded(AdvantageOptions, scale_rewards="batch", adv_std="population",
                                           adv_eps=1e-4, adv_clip_max=5.0)
    level_fraction: float = 0.99
    solver: Literal["dpm", "flow"] = "dpm"
    flow_shift: float = 3.0

    def __post_init__(self):
        check_fields(self)
        check_range("beta", self.beta, 0, SCALE_LIMIT, low_open=True, fix="the authors use 1.0 (0.1 for OCR)")
        check_range("level_fraction", self.level_fraction, 0, 1, low_open=True,
                    fix="the authors train int(0.99 T) of the T sampling noise levels")
        check_range("flow_shift", self.flow_shift, 0.01, SHIFT_LIMIT, fix="3.0 is usual")
        if self.advantage.adv_clip_max is None:
            raise ConfigError("adv_clip_max is DiffusionNFT's A_max (r = A / (2 A_max) + 1/2, the loss is scaled by "
                              "it): set it (the authors' 5).")


class DiffusionNFT:
    """DiffusionNFT: the optimality-weighted x0-space losses of the implicit positive and negative policies."""

    Config = DiffusionNFTConfig
    scoring = "likelihood"
    plan_family = "flow"  # the plan type `schedule` returns
    advantages = _options.advantages  # the shared advantage options

    def __init__(self, config: DiffusionNFTConfig):
        self.config = config
        self.kl = KLWeight(config.kl)  # the velocity KL's weight, moving under a schedule
        self.traits = AlgorithmTraits(
            reads=frozenset({"log_prob", "velocity", "target", "sigma"}),
            group_local_advantages=config.advantage.group_local,
            needs_reference=self.kl.ever_positive,
            has_state=True,  # the EMA old model and the step it owes, checkpointed
            after_step=True,  # the old model follows the weights once per training step
            old_source="old_model",
            old_score=True,  # the implicit policies read the old model's velocity
        )
        self.ema = ParameterEMA()

    def schedule(self, num_steps: int, generator: torch.Generator | None = None) -> FlowPlan:
        """Deterministic rollouts; ``int(level_fraction * num_steps)`` of the sampling noise levels (at least one), a
        random subset in random order, one unit each, with per-sample noise."""
        count = max(1, int(self.config.level_fraction * num_steps))
        order = torch.randperm(num_steps, generator=generator)[:count].tolist()
        return likelihood_plan(num_steps, order, self.config.solver, self.config.flow_shift, generator)

    # ------------------------------------------------------------------------------------- the EMA old model
    def old_policy(self, policy):
        """Context in which `policy` holds the old model's weights (the EMA, after the step it owes); the trainer scores
        the unit in it. The first read, before any update, makes the old model the initial weights (the authors'
        copy)."""
        self.ema.settle(policy.trainable_parameters())
        return self.ema.swapped(policy.trainable_parameters())

    def after_step(self) -> None:
        """The training step (the authors' rollout epoch) ended: the old model owes one EMA step, decay
        ``nft_decay(u, decay_type)`` with ``u`` the optimizer updates taken so far (the authors' ``global_step``)."""
        self.ema.owe(nft_decay(self.kl.updates, self.config.decay_type))

    def state_dict(self) -> dict:
        return {"ema": self.ema.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.ema.load_state_dict(state["ema"])

    # ------------------------------------------------------------------------------------------------- the loss
    def optimality(self, advantages: torch.Tensor) -> torch.Tensor:
        """The optimality probability ``r`` `[n]` of advantages `[n]`: clamped to ``[-A_max, A_max]``, reshaped by
        `adv_mode`, then ``clamp(A / (2 A_max) + 1/2, 0, 1)``."""
        a_max, mode = self.config.advantage.adv_clip_max, self.config.adv_mode
        adv = advantages.clamp(-a_max, a_max)
        if mode == "positive_only":
            adv = adv.clamp(0, a_max)
        elif mode == "negative_only":
            adv = adv.clamp(-a_max, 0)
        elif mode == "one_only":
            adv = (adv > 0).to(adv.dtype)
        elif mode == "binary":
            adv = torch.sign(adv)
        return (adv / a_max / 2.0 + 0.5).clamp(0, 1)

    def loss(self, new: Score, old: Score, advantages, ref: Score | None = None) -> LossOutput:
        """DiffusionNFT loss on one unit of noise levels.

        Args:
            new ([`Score`]): the policy's ``likelihood``: ``velocity`` `[n, k, ...]` (with gradient), ``target``
                `[n, k, ...]` (``eps - x0``), ``sigma`` `[n, k]`, ``log_prob`` `[n, k]`.
            old ([`Score`]): the old (EMA) model's ``likelihood`` at the same points (``traits.old_score``).
            advantages (`torch.FloatTensor` of shape `[n]`).
            ref ([`Score`], *optional*): the reference's ``likelihood`` (read by the KL term).
        """
        c = self.config
        v, v_old = new.velocity, old.velocity.detach()  # [n, k, ...]
        dims = tuple(range(2, v.dim()))
        t = new.sigma.to(v.dtype).reshape(*new.sigma.shape, *([1] * len(dims)))  # [n, k, 1, ...]
        r = self.optimality(advantages.to(v.dtype))[:, None]  # [n, 1]
        positive = c.beta * v + (1 - c.beta) * v_old  # [n, k, ...]
        negative = (1 + c.beta) * v_old - c.beta * v  # [n, k, ...]
        loss_pos = adaptive_x0_loss(t * (new.target - positive), dims)  # [n, k]
        loss_neg = adaptive_x0_loss(t * (new.target - negative), dims)  # [n, k]
        a_max = c.advantage.adv_clip_max
        policy_loss = ((r * loss_pos + (1 - r) * loss_neg) / c.beta * a_max).mean()
        loss = policy_loss
        metrics = {
            "policy_loss": policy_loss.item(),
            "fm_loss": (-new.log_prob).detach().mean().item(),
            "optimality_mean": r.mean().item(),
            "old_deviate": ((v.detach() - v_old) ** 2).mean().item(),
            "ratio_mean": torch.exp(new.log_prob.detach() - old.log_prob.detach()).mean().item(),  # exp(L_old - L)
        }
        loss = self.kl.add_velocity_kl(loss, metrics, new, ref)
        return LossOutput(loss=loss, metrics=metrics)


def adaptive_x0_loss(error: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    """DiffusionNFT's adaptively weighted x0-space loss ``mean(e^2 / w)``, ``w = stopgrad(max(mean|e|, 1e-5))`` per
    sample and level, `error` ``e = x0_hat - x0`` `[n, k, ...]` -> `[n, k]` (the weight in float64, as the authors')."""
    weight = error.detach().double().abs().mean(dim=dims, keepdim=True).clamp_min(1e-5)  # [n, k, 1, ...]
    return (error**2 / weight).mean(dim=dims).to(error.dtype)


PLUGIN = DiffusionNFT
