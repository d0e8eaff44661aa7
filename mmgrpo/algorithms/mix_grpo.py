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

MixGRPO-Flash (``dpm_algorithm_type: dpmsolver++``, the authors' ``--dpm_algorithm_type dpmsolver++
--dpm_apply_strategy post``): the steps up to the window's last step `b` are as above; the ODE after it is
DPM-Solver++ (2nd order multistep, `dpm_solver_type` ``midpoint`` in their scripts, final step 1st order) on a
compressed schedule of ``K = int(max((S - b) * dpm_post_compress_ratio, 1))`` noise levels, ``shift(linspace(t_{b+1},
0, K))`` with ``t_{b+1} = 1 - (b + 1) / S`` (``K - 1`` DPM steps instead of ``S - b - 1`` Euler steps; 25 steps,
window at 0: 7 instead of 21). The history of the first DPM step is the ``x0_hat`` of step `b` (with ``sde_type:
dance`` the authors' code keeps none: 1st order). Only window steps are trained, so the loss is unchanged. Their
scripts: MixGRPO-Flash, ratio 0.4 and ``iters_per_group`` 20; MixGRPO-Flash*, ratio 0.2 and ``prog_overlap_step`` 0
(the window stays at steps 0 .. 3). See [`mmgrpo.samplers.flow_dpm`].

Differences from the authors' code: ``sample_strategy: random`` draws each iteration's start from the plan's generator
(uniform in ``0 .. M - window_size``; theirs: NumPy's unseeded generator, the first iteration at 0); their ``decay``
and ``exp_decay`` strategies, ``advantage_rerange_strategy`` and ``trimmed_ratio`` are not implemented. When the start
reaches `M` the window is empty: that iteration samples with the ODE only and trains nothing (the authors' loop would
fail there; their runs stop before it). MixGRPO-Flash: diffusers' `DPMSolverMultistepScheduler` computes the DPM
steps (the same 2nd order updates as the authors' own solver); the time shift of the compressed levels is the one
through the pipeline's ``sigma_{b+1}`` (exactly the authors' levels where the pipeline's sigmas are a time shift of
``linspace(1, 0, S + 1)``, as SD3's, FLUX's and Wan's); ``K`` is at least 2 (at ``K = 1`` the authors' schedule would
stop above sigma 0); their ``dpm_solver_order`` 1 and 3, ``dpmsolver`` (not ++) and ``dpm_apply_strategy: all`` are
not implemented.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from ..losses import masked_mean
from ..plans import FlowPlan
from ..types import AlgorithmTraits, LossOutput, Score
from ..validation import ConfigError, check_fields, check_range, embedded
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
        prog_overlap_step (`int`): the move of an overlapping window (1; 0 keeps it in place, the authors'
            MixGRPO-Flash* script).
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
        dpm_algorithm_type (`str`, *optional*): ``"dpmsolver++"``: MixGRPO-Flash, DPM-Solver++ on a compressed schedule
            for the ODE steps after the window (the authors' ``--dpm_algorithm_type dpmsolver++`` with
            ``--dpm_apply_strategy post``); unset (their ``null``, the MixGRPO script): Euler ODE steps.
        dpm_post_compress_ratio (`float`): the ODE part after the window's last step `b` gets ``int(max((num_steps -
            b) * ratio, 1))`` noise levels (at least 2) down to 0 (0.4: MixGRPO-Flash; 0.2: MixGRPO-Flash*).
        dpm_solver_type (`str`): the 2nd order update, ``"midpoint"`` (the authors' scripts) or ``"heun"``.
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
    dpm_algorithm_type: Literal["dpmsolver++"] | None = None
    dpm_post_compress_ratio: float = 0.4
    dpm_solver_type: Literal["midpoint", "heun"] = "midpoint"

    def __post_init__(self):
        check_fields(self)
        check_range("window_size", self.window_size, 1, STEP_LIMIT, fix="the authors use 4 of 25 steps")
        check_range("iters_per_group", self.iters_per_group, 1, UPDATES_LIMIT,
                    fix="rollout iterations per window position; the authors use 25")
        check_range("prog_overlap_step", self.prog_overlap_step, 0, STEP_LIMIT,
                    fix="the authors move by 1 step (0 in MixGRPO-Flash*: the window stays)")
        check_range("old_kl_coeff", self.old_kl_coeff, 0, KL_BETA_LIMIT,
                    fix="0 turns the term off (the authors' script)")
        check_range("dpm_post_compress_ratio", self.dpm_post_compress_ratio, 0, 1, low_open=True,
                    fix="the share of the ODE steps after the window kept for DPM-Solver++: 0.4 (Flash), 0.2 (Flash*)")
        if self.dpm_algorithm_type is not None and self.sample_strategy != "progressive":
            raise ConfigError("dpm_algorithm_type (MixGRPO-Flash) needs sample_strategy: progressive, as the authors' "
                              "dpm_apply_strategy post; unset dpm_algorithm_type or use progressive.")


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
            schedule_reads_state=config.sample_strategy != "random",  # the progressive window reads the count
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
        """SDE on the window (each step a trained unit), ODE elsewhere (DPM-Solver++ after the window with
        MixGRPO-Flash); the window does not move here."""
        c = self.config
        steps = self.window(num_steps, generator)
        flash = c.dpm_post_compress_ratio if c.dpm_algorithm_type == "dpmsolver++" else 0.0  # MixGRPO-Flash
        return per_step_plan(num_steps, steps, c.sde, c.init_same_noise, generator, dpm_post_ratio=flash,
                             dpm_solver_type=c.dpm_solver_type)

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
