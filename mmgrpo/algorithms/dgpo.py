"""DGPO: direct group preference optimisation on the flow-matching loss of deterministic (ODE) rollouts.

Paper: https://arxiv.org/abs/2510.08425 (code: Luo-Yihong/DGPO). Rollouts use a fast deterministic solver
(``solver: dpm``: diffusers' DPM-Solver++ with flow sigmas, 10 steps, as the authors' code, which has no solver
option); there is no policy gradient through an SDE. Each sample is scored by the
policy's likelihood surrogate, ``-L(i)`` with ``L(i) = mean ||(eps - x0) - v(x_t)||^2`` at ``x_t = (1 - s) x0 + s eps``,
with the noise `eps` and the noise levels `s` shared within a group. The loss is the gradient of
``-log sigmoid(R(G+) - R(G-))`` with the implicit reward ``R(i) = -beta_dpo (L(i) - L_ref(i))``:

    S_g = mean_{i in g} A_i * beta_dpo * (L(i) - L_ref(i))          (no gradient)
    loss = mean_i sigmoid(S_{g(i)}) * A_i * L(i)  +  kl_beta * mean ||v(x_t) - v_ref(x_t)||^2

so positive-advantage samples get their flow-matching loss lowered and negative ones raised, and a group whose
preference is already satisfied (``S_g`` very negative) is down-weighted. The ratio ``exp(L_old(i) - L(i))`` against a
fast-EMA "old" copy of the weights clips (detaches) ``L(i)`` like PPO: when ``A > 0`` and it exceeds ``1 + clip_high``,
or ``A < 0`` and it falls below ``1 - clip_low`` (``clip_dsm``; ``clip_kl`` for the KL term; with both off nothing
reads the old model and its forward pass is skipped).

The fast EMA belongs to the algorithm, not the policy: it is part of how DGPO optimises (like the optimizer's moments),
it works unchanged for every pipeline (it only needs `trainable_parameters`), and the policy stays a model adapter.
The trainer evaluates the policy under [`~DGPO.old_policy`], calls [`~DGPO.after_update`] after every optimizer step
and checkpoints [`~DGPO.state_dict`], so resume is exact.

Differences from the authors' code: ``S_g`` averages over the group members present in the minibatch on this process
(the authors all-reduce complete groups; identical when a minibatch holds whole groups, e.g. ``minibatch_size`` equal
to the samples per process on one process); rollouts always use the current weights (the authors switch to the EMA
weights after ``switch_ema_ref`` updates).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from ..ema import ParameterEMA
from ..plans import FlowPlan
from ..types import AlgorithmTraits, LossOutput, Score
from ..validation import check_fields, check_range, embedded
from ._limits import SCALE_LIMIT, SHIFT_LIMIT, STEP_LIMIT
from . import _options
from ._options import AdvantageOptions, ClipOptions, KLOptions, KLWeight


@dataclass
class DGPOConfig:
    """Options of [`DGPO`]: its own and the shared clip, KL and advantage options (written flat, see
    ``mmgrpo show dgpo``) with the authors' defaults.

    Args:
        beta_dpo (`float`): scale of the implicit reward in the sigmoid group weight (10-100 against the frozen
            reference; 2000-5000 with `use_ema_ref`).
        kl_beta (`float`): weight of the velocity-space KL ``mean ||v - v_ref||^2`` to the reference (0: off).
        clip_low (`float`): clip of the denoising-loss ratio against the fast-EMA old
            model, ``[1 - clip_low, 1 + clip_high]`` (symmetric unset, DGPO's). With one optimizer update per rollout
            batch the old model is almost the sampling model, so the clip rarely or never triggers.
        clip_dsm (`bool`): detach a sample's flow-matching loss when its ratio is clipped.
        clip_kl (`bool`): also detach its KL term. With `clip_dsm` and `clip_kl` both false the clip acts on nothing:
            without `use_ema_ref` the old model is then not needed, and its forward pass is skipped (one of the three
            scoring passes per noise level).
        num_train_timesteps (`int`): noise levels scored per rollout batch (the plan's train units).
        trunc_steps (`int`): they are drawn without replacement from the first ``trunc_steps + 1`` sampling noise levels
            (the high-noise end; with 10 DPM steps and shift 3, 4 means ``sigma >= ~0.7``).
        adv_std (`str`): the std estimator of the advantages, ``"population"`` (n, DGPO's) or ``"unbiased"``.
        adv_clip_max (`float`, *optional*): advantages are clamped to ``[-adv_clip_max, adv_clip_max]`` (5).
        use_ema_ref (`bool`): the preference's reference is the fast-EMA old model instead of the frozen reference
            (TDM-R1's dynamic reference); the KL still uses the frozen reference.
        ema_decay_max (`float`), ema_decay_rate (`float`): the old model's EMA decay after `u` optimizer updates is
            ``min(ema_decay_max, ema_decay_rate * u)``.
        flow_shift (`float`): ``flow_shift`` of the DPM-Solver++ noise levels of the rollouts.
        solver (`str`): the rollouts' deterministic sampler, in `FlowPlan.solver`'s words: ``"dpm"``, the authors'
            (their code hard-wires diffusers' ``DPMSolverMultistepScheduler`` from Sana's flow-matching scheduler
            config with ``flow_shift`` 3; here DPM-Solver++ 2nd order with flow sigmas and `flow_shift`), or
            ``"flow"``, an mmgrpo variant: the pipeline's own Euler ODE and noise levels, i.e. the sampler that
            evaluation uses, so the samples RL ranks are the samples that are scored (`flow_shift` is then unused).
    """

    beta_dpo: float = 100.0
    kl: KLOptions = embedded(KLOptions, kl_beta=0.02)
    clip: ClipOptions = embedded(ClipOptions, clip_low=1e-2)
    clip_dsm: bool = True
    clip_kl: bool = False
    num_train_timesteps: int = 4
    trunc_steps: int = 4
    advantage: AdvantageOptions = embedded(AdvantageOptions, scale_rewards="group", adv_std="population",
                                           adv_eps=1e-4, adv_clip_max=5.0)
    use_ema_ref: bool = False
    ema_decay_max: float = 0.3
    ema_decay_rate: float = 1e-3
    flow_shift: float = 3.0
    solver: Literal["dpm", "flow"] = "dpm"

    def __post_init__(self):
        check_fields(self)
        check_range("trunc_steps", self.trunc_steps, 0, STEP_LIMIT)
        check_range("num_train_timesteps", self.num_train_timesteps, 1, STEP_LIMIT)
        check_range("beta_dpo", self.beta_dpo, 0, SCALE_LIMIT, low_open=True, fix="the authors use 10 to 100")
        check_range("ema_decay_max", self.ema_decay_max, 0, 1, high_open=True)
        check_range("ema_decay_rate", self.ema_decay_rate, 0, 1.0, fix="the old model's EMA decay grows by it")
        check_range("flow_shift", self.flow_shift, 0.01, SHIFT_LIMIT, fix="3.0 is usual")
        if self.trunc_steps + 1 < self.num_train_timesteps:
            raise ValueError(
                f"num_train_timesteps ({self.num_train_timesteps}) noise levels are drawn from the first "
                f"trunc_steps + 1 ({self.trunc_steps + 1}): raise trunc_steps or lower num_train_timesteps."
            )


class DGPO:
    """DGPO: sigmoid-weighted group preference on the flow-matching loss, clipped against a fast-EMA old model."""

    Config = DGPOConfig
    scoring = "likelihood"
    plan_family = "flow"  # the plan type `schedule` returns
    advantages = _options.advantages  # the shared advantage options

    def __init__(self, config: DGPOConfig):
        self.config = config
        self.kl = KLWeight(config.kl)  # the velocity KL's weight, moving under a schedule
        kl_reads = {"velocity"} if self.kl.ever_positive else set()  # the KL term is in velocity space
        self.traits = AlgorithmTraits(
            reads=frozenset({"log_prob", "group_ids"} | kl_reads),
            group_local_advantages=config.advantage.group_local,
            needs_reference=self.kl.ever_positive or not config.use_ema_ref,
            # without the KL, a sample with advantage 0 adds exactly nothing to the loss: the trainer need not score it
            zero_advantage_is_inert=not self.kl.ever_positive,
            has_state=True,  # the update count and the fast-EMA old model, checkpointed
            after_update=True,  # the old model follows the weights
            # the clip or the EMA reference reads the fast-EMA old model; otherwise nothing does and it is not scored
            old_source="old_model" if config.clip_dsm or config.clip_kl or config.use_ema_ref else "current",
        )
        self.ema = ParameterEMA()
        self.updates = 0

    def schedule(self, num_steps: int, generator: torch.Generator | None = None) -> FlowPlan:
        """Deterministic rollouts (DPM-Solver++ or the flow ODE); `num_train_timesteps` noise levels from the high-noise
        end."""
        c = self.config
        if c.trunc_steps >= num_steps:
            raise ValueError(
                f"algorithm.trunc_steps {c.trunc_steps} must be below the {num_steps} sampling steps (noise level "
                f"index {num_steps} is the clean sample)."
            )
        order = torch.randperm(c.trunc_steps + 1, generator=generator)[: c.num_train_timesteps]
        return FlowPlan(
            num_steps=num_steps,
            sde_steps=[],
            train_units=[[int(j)] for j in order],
            noise_level=0.0,
            solver=c.solver,
            flow_shift=c.flow_shift,
            scoring="likelihood",
            seed=int(torch.randint(0, 2**62, (1,), generator=generator)),
        )

    # ---------------------------------------------------------------------------------- the fast-EMA old model
    def old_policy(self, policy):
        """Context in which `policy` holds the fast-EMA weights; the trainer scores the old model inside it when
        ``traits.old_source`` is ``"old_model"`` (a clip or `use_ema_ref`; otherwise nothing reads the old model and
        its forward pass is skipped)."""
        return self.ema.swapped(policy.trainable_parameters())

    def after_update(self, policy) -> None:
        """One EMA step after an optimizer update, decay ``min(ema_decay_max, ema_decay_rate * updates)``."""
        if self.traits.old_source == "old_model":
            decay = min(self.config.ema_decay_max, self.config.ema_decay_rate * self.updates)
            self.ema.update(policy.trainable_parameters(), decay)
        self.updates += 1

    def state_dict(self) -> dict:
        return {"updates": self.updates, "ema": self.ema.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.updates = state["updates"]
        self.ema.load_state_dict(state["ema"])

    # ------------------------------------------------------------------------------------------------- the loss
    def loss(self, new: Score, old_log_prob, advantages, ref: Score | None = None) -> LossOutput:
        """DGPO loss on one unit of noise levels.

        Args:
            new ([`Score`]): the policy's ``likelihood``: ``log_prob`` `[n, k]` (``-L``), ``velocity`` `[n, k, ...]`,
                ``group_ids`` `[n]`.
            old_log_prob (`torch.FloatTensor` of shape `[n, k]`): ``-L_old`` of the fast-EMA old model.
            advantages (`torch.FloatTensor` of shape `[n]`).
            ref ([`Score`], *optional*): the reference's ``likelihood`` (needed unless `use_ema_ref` and no KL).
        """
        c = self.config
        fm = -new.log_prob  # [n, k] flow-matching loss L(i), with gradient
        adv = advantages[:, None].to(fm.dtype)  # [n, 1]
        ratio = torch.exp(new.log_prob.detach() - old_log_prob)  # [n, k] = exp(L_old - L)
        clipped = torch.where(adv > 0, ratio > 1 + c.clip.high, ratio < 1 - c.clip.clip_low)  # [n, k]
        clipped &= c.clip_dsm or c.clip_kl  # where the clip detaches something
        fm_used = torch.where(clipped, fm.detach(), fm) if c.clip_dsm else fm
        fm_ref = -old_log_prob if c.use_ema_ref else -ref.log_prob  # [n, k]
        weights = group_weights(adv * c.beta_dpo * (fm.detach() - fm_ref), new.group_ids)  # [n, k]
        policy_loss = (weights * adv * fm_used).mean()
        loss = policy_loss
        metrics = {
            "policy_loss": policy_loss.item(),
            "fm_loss": fm.detach().mean().item(),
            "group_weight": weights.mean().item(),
            "ratio_mean": ratio.mean().item(),
            "clip_frac": clipped.float().mean().item(),
        }
        beta = self.kl()
        if beta > 0:
            dims = tuple(range(2, new.velocity.dim()))
            kl = ((new.velocity - ref.velocity.detach()) ** 2).mean(dim=dims)  # [n, k]
            kl = torch.where(clipped, kl.detach(), kl) if c.clip_kl else kl
            loss = loss + beta * kl.mean()
            metrics.update(kl=kl.mean().item(), kl_beta=float(beta))
        return LossOutput(loss=loss, metrics=metrics)


def group_weights(terms: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """DGPO's group weight ``sigmoid(S_g)``, ``S_g`` the mean of `terms` over the members of group `g`.

    Args:
        terms (`torch.FloatTensor` of shape `[n, k]`): ``A_i * beta_dpo * (L(i) - L_ref(i))`` per sample and noise
            level.
        group_ids (`torch.LongTensor` of shape `[n]`).

    Returns:
        `torch.FloatTensor` of shape `[n, k]`: each sample's group weight (no gradient).
    """
    terms = terms.detach()
    _, inverse = torch.unique(group_ids.to(terms.device), return_inverse=True)
    sums = terms.new_zeros((int(inverse.max()) + 1, terms.shape[1])).index_add_(0, inverse, terms)  # [groups, k]
    counts = torch.bincount(inverse).to(terms.dtype)[:, None]  # [groups, 1]
    return torch.sigmoid(sums / counts)[inverse]  # [n, k]


PLUGIN = DGPO
