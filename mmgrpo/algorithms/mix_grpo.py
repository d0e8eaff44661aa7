"""MixGRPO: SDE sampling and training only inside a window of consecutive steps that slides along the trajectory as
training proceeds; ODE steps elsewhere.

Paper: https://arxiv.org/abs/2507.21802 (code: Tencent-Hunyuan/MixGRPO, ``fastvideo/train_grpo_flux.py``, the window
scheduler ``fastvideo/utils/grpo_states.py``; verl-omni ``docs/algo/mixgrpo.md``). At rollout iteration `t` the window
is ``range(c_t, min(c_t + window_size, M))`` with ``M = num_steps - 2`` (the authors' ``max_timesteps``). Its start
follows the authors' ``progressive`` scheduler: ``c_0 = 0``; after each iteration a counter advances, and every
`iters_per_group` iterations the start moves by `prog_overlap_step` (by `window_size` with ``prog_overlap: false``);
past `M` it rolls back to 0 (or stays at `M` with ``roll_back: false``). The window steps sample with Flow-GRPO's SDE
(``sde_type: sde``, the authors' ``--flow_grpo_sampling``, their script's choice) or DanceGRPO's (``sde_type: dance``,
the flag off), every other step with the ODE (Euler), and each sample trains every window step. With `A` the
group-normalised advantage (``(r - mean) / (std + 1e-8)``, PyTorch's unbiased std) clamped to ``[-5, 5]``, each
(sample, window step) pair adds

    L = max(-A r, -A clip(r, 1 - 1e-4, 1 + 1e-4)) + old_kl_coeff * (log r)^2 / 2,   r = pi_theta / pi_old (x' | x)

averaged over the pairs (the authors' k2 term to the sampling policy, off in their script). `kl_beta` adds the exact
KL of the Gaussian transitions to the reference (0 by default: no reference forward). With `init_same_noise` (their
script) the members of a group share one initial noise. Several rewards: the `composite` reward's ``normalize:
advantage_aggr`` is the authors' default ``multi_reward_mix``.

The window position is the algorithm's state: the trainer calls ``after_step`` once per training step (one rollout,
``traits.after_step``), and the count is checkpointed (``traits.has_state``), so a resumed run keeps its window.
Evaluation samples with the ODE and moves nothing.

Differences from the authors' code: ``sample_strategy: random`` draws each iteration's start from the plan's generator
(uniform in ``0 .. M - window_size``; theirs: NumPy's unseeded generator, the first iteration at 0); their ``decay``
and ``exp_decay`` strategies, ``advantage_rerange_strategy``, ``trimmed_ratio`` and MixGRPO-Flash (DPM-Solver++ on the
ODE steps after the window) are not implemented. When the start reaches `M` the window is empty: that iteration
samples with the ODE only and trains nothing (the authors' loop would fail there; their runs stop before it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from ..losses import masked_mean
from ..plans import FlowPlan
from ..types import AlgorithmTraits, LossOutput, Score
from ..validation import check_fields, check_range, embedded
from ._limits import KL_BETA_LIMIT, STEP_LIMIT, UPDATES_LIMIT
from . import _options
from ._flow_common import fastvideo_surrogate, per_step_plan
from ._options import FASTVIDEO_ADVANTAGES, AdvantageOptions, ClipOptions, KLOptions, KLWeight, SDEOptions


@dataclass
class MixGRPOConfig:
    """Options of [`MixGRPO`]: its own and the shared clip, KL, advantage and SDE options (written flat, see
    ``mmgrpo show mix_grpo``) with the authors' defaults (their ``finetune_flux_grpo_MixGRPO.sh``).

    Args:
        window_size (`int`): consecutive SDE (and trained) steps, the authors' ``--group_size`` (4 of 25 steps).
        sample_strategy (`str`): how the window moves: ``"progressive"`` (the authors' default, see the module
            docstring) or ``"random"`` (a start drawn uniformly in ``0 .. num_steps - 2 - window_size`` each iteration).
        iters_per_group (`int`): rollout iterations the window stays in place (``"progressive"``; 25).
        prog_overlap (`bool`): the window moves by `prog_overlap_step` (their script) or, false, by `window_size`.
        prog_overlap_step (`int`): the move of an overlapping window (1).
        roll_back (`bool`): past the last start the window returns to step 0 (their script); false: it stays there.
        init_same_noise (`bool`): the members of a group start from one initial noise (their script).
        old_kl_coeff (`float`): weight of the authors' ``kl_coeff`` term, ``0.5 * (log pi_theta - log pi_old)^2`` per
            trained pair, a k2 estimate of the KL to the sampling policy (0 in their script; their argument's default is
            0.01). Named apart from `kl_beta` (the KL to the reference, which ``kl_coeff`` names elsewhere).
        noise_level (`float`): eta of the window's SDE (0.7 with Flow-GRPO's SDE; DanceGRPO's default is 0.3).
        sde_type (`str`): ``"sde"`` (Flow-GRPO's SDE, the authors' ``--flow_grpo_sampling``), ``"dance"``
            (DanceGRPO's, the flag off) or ``"cps"``.
        clip_low (`float`): the per-step ratio is clipped to ``[1 - clip_low, 1 + clip_high]`` (1e-4, symmetric).
        adv_std (`str`), adv_eps (`float`): the authors' unbiased std (PyTorch's ``std``) + 1e-8.
        adv_clip_max (`float`, *optional*): advantages are clamped to ``[-adv_clip_max, adv_clip_max]`` (5), in the
            loss as the authors do (so also the advantages a `composite` reward gives as they are).
        kl_beta (`float`): weight of the exact transition KL to the reference (0: no reference forward).
    """

    window_size: int = 4
    sample_strategy: Literal["progressive", "random"] = "progressive"
    iters_per_group: int = 25
    prog_overlap: bool = True
    prog_overlap_step: int = 1
    roll_back: bool = True
    init_same_noise: bool = True
    old_kl_coeff: float = 0.0
    clip: ClipOptions = embedded(ClipOptions, clip_low=1e-4)
    advantage: AdvantageOptions = embedded(AdvantageOptions, **FASTVIDEO_ADVANTAGES)
    kl: KLOptions = embedded(KLOptions, kl_beta=0.0)
    sde: SDEOptions = embedded(SDEOptions, noise_level=0.7, sde_type="sde")

    def __post_init__(self):
        check_fields(self)
        check_range("window_size", self.window_size, 1, STEP_LIMIT, fix="the authors use 4 of 25 steps")
        check_range("iters_per_group", self.iters_per_group, 1, UPDATES_LIMIT,
                    fix="rollout iterations per window position; the authors use 25")
        check_range("prog_overlap_step", self.prog_overlap_step, 1, STEP_LIMIT, fix="the authors move by 1 step")
        check_range("old_kl_coeff", self.old_kl_coeff, 0, KL_BETA_LIMIT,
                    fix="0 turns the term off (the authors' script)")


def progressive_start(iterations: int, num_steps: int, config: MixGRPOConfig) -> int:
    """The window start after `iterations` rollout iterations under the authors' ``progressive`` rule (their
    ``GRPOTrainingStates.update_iteration``, replayed from the start: ``max_timesteps = num_steps - 2``)."""
    last = num_steps - 2
    move = config.prog_overlap_step if config.prog_overlap else config.window_size
    start, in_place = 0, 0
    for _ in range(iterations):
        in_place += 1
        if in_place >= config.iters_per_group:
            in_place, start = 0, start + move
        if start > last:
            start, in_place = (0, 0) if config.roll_back else (last, in_place)
    return start


class MixGRPO:
    """MixGRPO: a sliding window of SDE (and trained) steps, ODE elsewhere; group-normalised advantages."""

    Config = MixGRPOConfig
    scoring = "trajectory"
    plan_family = "flow"  # the plan type `schedule` returns
    advantages = _options.advantages  # the shared advantage options

    def __init__(self, config: MixGRPOConfig):
        self.config = config
        self.kl = KLWeight(config.kl)  # the KL weight (to the reference), moving under a schedule
        self.iterations = 0  # rollout iterations done: the window's clock (state, checkpointed)
        self.traits = AlgorithmTraits(
            reads=frozenset({"log_prob"}) | self.kl.transition_reads,
            needs_reference=self.kl.ever_positive,
            group_local_advantages=config.advantage.group_local,
            has_state=True,  # the rollout iterations counted
            after_step=True,  # counts one per training step
        )

    def window(self, num_steps: int, generator: torch.Generator | None = None) -> list[int]:
        """The SDE (and trained) steps of the current iteration: ``range(start, min(start + window_size,
        num_steps - 2))``."""
        c, last = self.config, num_steps - 2
        if last < 1:
            raise ValueError(f"MixGRPO's window lies in steps 0 .. num_steps - 3; pipeline.num_steps {num_steps} "
                             "leaves none: use at least 3 steps.")
        if c.sample_strategy == "random":
            start = int(torch.randint(0, max(1, last - c.window_size + 1), (1,), generator=generator))
        else:
            start = progressive_start(self.iterations, num_steps, c)
        return list(range(start, min(start + c.window_size, last)))

    def schedule(self, num_steps: int, generator: torch.Generator | None = None) -> FlowPlan:
        """SDE on the window (each step a trained unit), ODE elsewhere; the window does not move here."""
        steps = self.window(num_steps, generator)
        return per_step_plan(num_steps, steps, self.config.sde, self.config.init_same_noise, generator)

    def after_step(self) -> None:
        """One rollout iteration done: the window's clock advances (the authors' ``update_iteration``)."""
        self.iterations += 1

    def state_dict(self) -> dict:
        return {"iterations": self.iterations}

    def load_state_dict(self, state: dict) -> None:
        self.iterations = int(state["iterations"])

    def loss(self, new: Score, old_log_prob, advantages, ref: Score | None = None) -> LossOutput:
        """Clipped surrogate on one window step, plus the authors' k2 term and the KL term.

        Args:
            new ([`Score`]): ``log_prob`` `[n, 1]`; with a KL term ``mean`` `[n, 1, ...]` and ``std`` `[n, 1, 1, ...]`.
            old_log_prob (`torch.FloatTensor` of shape `[n, 1]`): log-probs recorded at sampling.
            advantages (`torch.FloatTensor` of shape `[n]`).
            ref ([`Score`], *optional*): the reference policy's ``mean`` for the KL term.
        """
        c = self.config
        log_ratio = new.log_prob - old_log_prob  # [n, 1]
        loss, metrics = fastvideo_surrogate(log_ratio, advantages, c.advantage, c.clip, new.mask)
        if c.old_kl_coeff > 0:
            k2 = masked_mean(0.5 * log_ratio**2, new.mask)
            loss = loss + c.old_kl_coeff * k2
            metrics.update(k2=k2.item())
        loss = self.kl.add_transition_kl(loss, metrics, new, ref)
        return LossOutput(loss=loss, metrics=metrics)


PLUGIN = MixGRPO
