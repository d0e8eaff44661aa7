"""AWM: advantage weighted matching, the pre-training flow-matching loss on the policy's own samples, weighted by the
advantage.

Paper: https://arxiv.org/abs/2509.25050 (the rule and defaults as published in X-GenGroup/Flow-Factory,
``trainers/awm.py`` and ``examples/awm/lora/sd3_5/default.yaml``, the configuration that reproduces the paper's
PickScore run). Rollouts use a deterministic solver (the pipeline's Euler ODE, ``solver: flow``, or ``dpm``); each final
sample ``x0`` is noised afresh, ``x_t = (1 - t) x0 + t eps`` with its own ``eps`` (``FlowPlan.likelihood_noise =
"sample"``), at `num_train_timesteps` sampling noise levels drawn stratified per step, and scored by its weighted
flow-matching "log-probability":

    l   = mean ||v(x_t) - (eps - x0)||^2                       (in float64)
    lp  = -w(l, t):  Uniform: l;  t: t l;  t**2: t^2 l;  huber: t (sqrt(l + 1e-10) - 1e-5);
                     ghuber: t ((l + 1e-10)^p - 1e-10^p) / p   (p = ghuber_power)
    loss = -mean_i A_i * exp(lp_i - sg(lp_i))  +  kl_beta * mean ||v - v_ref||^2  +  ema_kl_beta * mean ||v - v_ema||^2

so the gradient is ``A`` times the gradient of the weighted matching loss: positive-advantage samples are fitted,
negative ones pushed away. ``v_ema`` is an EMA of the trained weights (``traits.old_score``: the old model's velocity
at the same points), stepped once per training step (the authors' epoch), decay ``ema_decay * min(e / ema_warmup_steps,
1)`` at the end of step ``e`` (counted from 0: Flow-Factory's ``linear`` EMA schedule from 0, called with the epoch);
it soft-limits how fast the policy moves. The step is owed at the end of the training step ([`~AWM.after_step`]) and
taken before the EMA is next read (the weights do not change in between). The EMA belongs to the
algorithm (it only needs `trainable_parameters`), so AWM works unchanged for every flow pipeline.

Differences from the authors' code:

- The authors' PPO clip of ``exp(lp - lp_old)`` acts on nothing: their ``lp_old`` is computed under the current weights
  just before each batch trains (``off_policy: false``, the published setting), so the ratio is 1 and the loss is the
  one above; ``off_policy: true`` (rollouts and ``lp_old`` from the EMA) is not offered.
- The time sampling ``discrete*`` is the authors' stratified draw over sampling-step indices, but the range is cut by
  index, ``i <= step_range * T`` (a variant of their ``timestep_range``, which cuts at the noise level
  ``t >= 1 - timestep_range``): the algorithm does not know the pipeline's noise levels when it plans.
- Advantages use the shared options: the group mean over the batch's population std (``global_std: true``), plus
  ``adv_eps`` 1e-6 where the authors floor the std at 1e-6; clamped to ``adv_clip_max`` (their ``adv_clip_range`` 1.0)
  and, with ``advantage_max``, rescaled as the authors' own code does (``clamp(A, -c, c) / c * advantage_max``).
- The authors evaluate on the EMA weights; mmgrpo evaluates the trained weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from ..ema import ParameterEMA
from ..plans import FlowPlan
from ..types import AlgorithmTraits, LossOutput, Score
from ..validation import ConfigError, check_fields, check_range, embedded
from ._limits import ADV_CLIP_LIMIT, KL_BETA_LIMIT, SHIFT_LIMIT, STEP_LIMIT, UPDATES_LIMIT
from . import _options
from ._flow_common import likelihood_plan
from ._options import AdvantageOptions, KLOptions, KLWeight

Weighting = Literal["Uniform", "t", "t**2", "huber", "ghuber"]
TimeSampling = Literal["discrete", "discrete_with_init", "discrete_wo_init"]


@dataclass
class AWMConfig:
    """Options of [`AWM`]: its own and the shared KL and advantage options (written flat, see ``mmgrpo show awm``), with
    the authors' published defaults (Flow-Factory ``examples/awm/lora/sd3_5/default.yaml``).

    Args:
        awm_weighting (`str`): the weighting ``w(l, t)`` of the matching loss ``l`` at noise level ``t`` (the authors'
            names): ``"Uniform"`` (``l``), ``"t"``, ``"t**2"``, ``"huber"`` (``t (sqrt(l + 1e-10) - 1e-5)``) or
            ``"ghuber"`` (``t ((l + 1e-10)^p - 1e-10^p) / p``, the published choice).
        ghuber_power (`float`): ``p`` of ``"ghuber"`` (0.25).
        num_train_timesteps (`int`): noise levels trained per step, shared by the step's samples (6).
        time_sampling_strategy (`str`): how they are drawn among the sampling-step indices ``0 .. R`` (``R`` from
            `step_range`), stratified into `num_train_timesteps` equal spans with one uniform draw in each (the
            authors' ``TimeSampler.discrete``): ``"discrete"`` (from index 0), ``"discrete_wo_init"`` (from index 1:
            never the pure-noise level; published) or ``"discrete_with_init"`` (index 0 always, the rest from 1).
        step_range (`float`): the share of the sampling steps, from the high-noise end, the draws come from: indices
            ``i <= step_range * T`` (a variant of the authors' ``timestep_range`` 0.9, which cuts at the noise level).
        kl_beta (`float`): weight of the velocity KL ``mean ||v - v_ref||^2`` to the reference (1e-4).
        ema_kl_beta (`float`): weight of the velocity KL ``mean ||v - v_ema||^2`` to the EMA of the weights (1; 0 turns
            it off, and the EMA with it).
        ema_decay (`float`): the EMA's final decay (0.3), reached linearly from 0 over `ema_warmup_steps`.
        ema_warmup_steps (`int`): the EMA updates over which its decay rises from 0 to `ema_decay` (the authors'
            ``warmup_steps``, 1000, of their ``linear`` EMA schedule).
        adv_clip_max (`float`): the advantages are clamped to ``[-adv_clip_max, adv_clip_max]`` (the published
            ``adv_clip_range`` 1.0).
        advantage_max (`float`, *optional*): the authors' ``advantage_max``: the clamped advantages are multiplied by
            ``advantage_max / adv_clip_max``, so they span ``[-advantage_max, advantage_max]`` (the authors' own
            GenEval, OCR and PickScore configurations: 1 with ``adv_clip_max`` 5). Unset (Flow-Factory's): not scaled.
        solver (`str`): the rollouts' deterministic sampler, in `FlowPlan.solver`'s words: ``"flow"`` (the pipeline's
            Euler ODE on its own noise levels: Flow-Factory's ``ODE`` dynamics, published) or ``"dpm"``.
        flow_shift (`float`): ``flow_shift`` of the DPM-Solver++ noise levels (unused by ``"flow"``).
    """

    awm_weighting: Weighting = "ghuber"
    ghuber_power: float = 0.25
    num_train_timesteps: int = 6
    time_sampling_strategy: TimeSampling = "discrete_wo_init"
    step_range: float = 0.9
    kl: KLOptions = embedded(KLOptions, kl_beta=1e-4)
    ema_kl_beta: float = 1.0
    ema_decay: float = 0.3
    ema_warmup_steps: int = 1000
    advantage: AdvantageOptions = embedded(AdvantageOptions, scale_rewards="batch", adv_std="population",
                                           adv_eps=1e-6, adv_clip_max=1.0)
    advantage_max: float | None = None
    solver: Literal["dpm", "flow"] = "flow"
    flow_shift: float = 3.0

    def __post_init__(self):
        check_fields(self)
        check_range("ghuber_power", self.ghuber_power, 0, 1, low_open=True, fix="the authors use 0.25")
        check_range("num_train_timesteps", self.num_train_timesteps, 1, STEP_LIMIT)
        check_range("step_range", self.step_range, 0, 1, low_open=True, fix="the authors draw from 90% of the steps")
        check_range("ema_kl_beta", self.ema_kl_beta, 0, KL_BETA_LIMIT, fix="0 turns the EMA KL off; published: 1")
        check_range("ema_decay", self.ema_decay, 0, 1, high_open=True, fix="published: 0.3")
        check_range("ema_warmup_steps", self.ema_warmup_steps, 1, UPDATES_LIMIT, fix="published: 1000")
        check_range("flow_shift", self.flow_shift, 0.01, SHIFT_LIMIT, fix="3.0 is usual")
        if self.advantage_max is not None:
            check_range("advantage_max", self.advantage_max, 0, ADV_CLIP_LIMIT, low_open=True,
                        fix="the authors use 1 (with adv_clip_max 5)")
            if self.advantage.adv_clip_max is None:
                raise ConfigError("algorithm.advantage_max rescales the clamped advantages by advantage_max / "
                                  "adv_clip_max: set adv_clip_max too (the authors: 5) or leave advantage_max unset.")


def stratified_levels(num_steps: int, config: AWMConfig, generator: torch.Generator | None) -> list[int]:
    """The authors' ``TimeSampler.discrete`` over step indices ``0 .. R``, ``R = min(T - 1, step_range * T)``: the span
    ``[start, R]`` cut into `num_train_timesteps` equal strata by ``linspace``, one uniform draw in each (floored)."""
    last = min(num_steps - 1, int(config.step_range * num_steps + 1e-9))
    count, strategy = config.num_train_timesteps, config.time_sampling_strategy
    forced = strategy == "discrete_with_init"
    start = 0 if strategy == "discrete" else min(1, last)
    if forced:
        count -= 1
        if count == 0:
            return [0]
    bounds = torch.linspace(start, last, count + 1)
    lower, upper = bounds[:-1].long(), bounds[1:].long()
    u = torch.rand(count, generator=generator)
    picks = (lower + (u * (upper - lower)).long()).clamp(0, num_steps - 1).tolist()
    return [0] * forced + picks


class AWM:
    """AWM: the advantage-weighted flow-matching loss, held near an EMA of the weights and the reference."""

    Config = AWMConfig
    scoring = "likelihood"
    plan_family = "flow"  # the plan type `schedule` returns
    advantages = _options.advantages  # the shared advantage options

    def __init__(self, config: AWMConfig):
        self.config = config
        self.kl = KLWeight(config.kl)  # the reference KL's weight, moving under a schedule
        use_ema = config.ema_kl_beta > 0
        self.traits = AlgorithmTraits(
            reads=frozenset({"log_prob", "velocity", "sigma"}),
            group_local_advantages=config.advantage.group_local,
            needs_reference=self.kl.ever_positive,
            zero_advantage_is_inert=not (self.kl.ever_positive or use_ema),
            has_state=True,  # the step count and the EMA, checkpointed
            after_step=True,  # the EMA follows the weights once per training step
            old_source="old_model" if use_ema else "current",
            old_score=True,  # the EMA KL reads the EMA's velocity at the same points
        )
        self.ema = ParameterEMA()
        self.steps = 0  # training steps ended (the authors' epochs)

    def schedule(self, num_steps: int, generator: torch.Generator | None = None) -> FlowPlan:
        """Deterministic rollouts; `num_train_timesteps` stratified noise levels, one unit each, per-sample noise."""
        levels = stratified_levels(num_steps, self.config, generator)
        return likelihood_plan(num_steps, levels, self.config.solver, self.config.flow_shift, generator)

    # ----------------------------------------------------------------------------------------------- the EMA
    def ema_decay(self, step: int) -> float:
        """The EMA's decay at the end of training step `step` (from 0): ``ema_decay * min(step / ema_warmup_steps, 1)``
        (Flow-Factory's ``linear_warmup_decay`` from 0, called with the epoch)."""
        return self.config.ema_decay * min(step / self.config.ema_warmup_steps, 1.0)

    def old_policy(self, policy):
        """Context in which `policy` holds the EMA weights (after the step it owes); the trainer scores the unit in it
        for the EMA KL. The first read, before any update, makes the EMA the initial weights."""
        self.ema.settle(policy.trainable_parameters())
        return self.ema.swapped(policy.trainable_parameters())

    def after_step(self) -> None:
        """The training step (the authors' epoch) ended: the EMA owes one step of ``ema_decay(step)`` (when the EMA KL
        is on)."""
        if self.traits.old_source == "old_model":
            self.ema.owe(self.ema_decay(self.steps))
        self.steps += 1

    def state_dict(self) -> dict:
        return {"steps": self.steps, "ema": self.ema.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.steps = state["steps"]
        self.ema.load_state_dict(state["ema"])

    # ------------------------------------------------------------------------------------------------- the loss
    def weighted_log_prob(self, score: Score) -> torch.Tensor:
        """The authors' ``compute_weighted_log_prob``: ``-w(l, t)`` `[n, k]` in float64, ``l`` the mean squared error
        of `score`'s velocity against ``eps - x0`` (``log_prob = -l``), ``t`` its ``sigma``."""
        loss = -score.log_prob.double()  # [n, k] = l
        t = score.sigma.double()  # [n, k]
        weighting, p, tiny = self.config.awm_weighting, self.config.ghuber_power, 1e-10
        if weighting == "Uniform":
            return -loss
        if weighting == "t":
            return -loss * t
        if weighting == "t**2":
            return -loss * t**2
        if weighting == "huber":
            return -(torch.sqrt(loss + tiny) - 1e-5) * t
        return -((loss + tiny) ** p - tiny**p) * t / p  # ghuber

    def loss(self, new: Score, old: Score, advantages, ref: Score | None = None) -> LossOutput:
        """AWM loss on one unit of noise levels.

        Args:
            new ([`Score`]): the policy's ``likelihood``: ``log_prob`` `[n, k]` (minus the matching loss, with
                gradient), ``velocity`` `[n, k, ...]`, ``sigma`` `[n, k]`.
            old ([`Score`]): the EMA's ``likelihood`` at the same points (the current score, detached, without the EMA
                KL).
            advantages (`torch.FloatTensor` of shape `[n]`).
            ref ([`Score`], *optional*): the reference's ``likelihood`` (read by the KL term).
        """
        c = self.config
        a_max = c.advantage.adv_clip_max
        adv = advantages.double()[:, None]  # [n, 1]
        if a_max is not None:
            adv = adv.clamp(-a_max, a_max)
            if c.advantage_max is not None:  # the authors' rescaling into [-advantage_max, advantage_max]
                adv = adv / a_max * c.advantage_max
        lp = self.weighted_log_prob(new)  # [n, k]
        ratio = torch.exp(lp - lp.detach())  # [n, k] = 1: the sampling policy is the current one
        policy_loss = (-adv * ratio).mean().float()
        loss = policy_loss
        dims = tuple(range(2, new.velocity.dim()))
        metrics = {"policy_loss": policy_loss.item(), "fm_loss": (-new.log_prob).detach().mean().item(),
                   "weighted_loss": (-lp).detach().mean().item(), "ratio_mean": ratio.detach().mean().item()}
        loss = self.kl.add_velocity_kl(loss, metrics, new, ref)
        if c.ema_kl_beta > 0:
            ema_kl = ((new.velocity - old.velocity.detach()) ** 2).mean(dim=dims)  # [n, k]
            loss = loss + c.ema_kl_beta * ema_kl.mean()
            metrics.update(ema_kl=ema_kl.mean().item())
        return LossOutput(loss=loss, metrics=metrics)


PLUGIN = AWM
