"""Sampling plans, one type per plan family: what an algorithm's ``schedule`` returns and a pipeline's ``sample``
reads. [`FlowPlan`] (``"flow"``: which denoising steps are stochastic and which are trained), [`TokenPlan`]
(``"token"``: autoregressive decisions) and [`MaskedPlan`] (``"masked"``: masked-diffusion decoding steps). A plan
names the opt-in features it uses (``features()``); a pipeline lists those it implements (``plan_features``), and the
trainer refuses a plan asking for more before any model loads.

Shape letters as in [`mmgrpo.types`]: ``S`` decisions (denoising steps, tokens, unmasking steps).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Union

FLOW_PLAN_FEATURES = frozenset({"merge", "branch", "init_same_noise", "unit_selection", "dpm", "likelihood",
                                "sample_noise", "tree", "old_mean", "dpm_post"})
# plan feature -> the `Score` fields a pipeline's scoring method fills only for a plan that uses the feature (its
# ``provides`` lists them; an algorithm reading one must ask for the feature, which the checks before loading verify)
FEATURE_SCORE_FIELDS = {"old_mean": frozenset({"old_mean"})}


@dataclass
class FlowPlan:
    """A flow-matching plan (family ``"flow"``): which denoising steps are stochastic (SDE) and which are trained.
    [`mmgrpo.samplers.flow_plan`] interprets it for the flow adapters (`sd3`, `flux`).

    The first five fields describe a plain plan (every sample follows the same steps); the others are opt-in
    features named by [`~FlowPlan.features`]. A policy lists the features it implements in its
    ``plan_features`` attribute and the trainer refuses a plan that asks for more, so no feature is silently ignored.

    Args:
        num_steps (`int`): number of sampling steps `S`.
        sde_steps (`list[int]`): indices of steps that sample stochastically (the others are deterministic).
        train_units (`list[list[int]]`): the trained steps, grouped into units that are scored and back-propagated
            together (one step each for Flow-GRPO; a chunk of steps for Chunk-GRPO). With ``"trajectory"`` scoring
            every step in a unit must be in `sde_steps`; with ``"likelihood"`` scoring a unit lists indices of the
            sampling noise levels at which the likelihood is evaluated.
        noise_level (`float`): the SDE noise scale (eta).
        sde_type (`str`): ``"sde"`` (Flow-GRPO) or ``"cps"`` (coefficients-preserving sampling).
        merge (`dict[int, int]`): feature ``"merge"``: SDE step `i` -> `m`, the step jumps from ``sigma_i`` to
            ``sigma_{i+m}`` in one transition (E-GRPO's merged step); the skipped steps are not taken.
        merge_entropy (`float`, *optional*): feature ``"merge"``, adaptive: each SDE step not in `merge` spans the
            fewest intervals (at most `max_merge`) whose transition entropy per latent element,
            ``0.5 * log(2 * pi * e * std^2)`` in nats, reaches this value.
        max_merge (`int`): the longest adaptive merge.
        branch (`bool`): feature ``"branch"``: the samples of a group share one initial noise and one deterministic
            anchor trajectory; member `m` of each group (see `PromptBatch.member_ids`) takes a single SDE step, at
            ``sde_steps[m % len(sde_steps)]``, and continues deterministically. The rollout's group ids become
            ``group_id * len(sde_steps) + branch`` (samples sharing a prompt *and* an SDE step, E-GRPO's multi-step
            group normalisation); see [`mmgrpo.samplers.flow_plan.branch_group_ids`].
        seed (`int`): seed of the noise shared within a group (the branch anchor's initial noise, the likelihood's
            noise); drawn by the algorithm from the generator that is seeded identically on every process.
        init_same_noise (`bool`): feature ``"init_same_noise"`` (DanceGRPO's and MixGRPO's ``--init_same_noise``): the
            samples of a group start from one initial noise, drawn from `seed` and the group id, so it is the same on
            every process (see [`mmgrpo.samplers.flow_plan.group_noise`]); they differ only by their SDE noise. Not
            with `branch` or a tree, whose groups share their root noise already.
        units_per_sample (`int`): feature ``"unit_selection"``: each sample trains only this many of `train_units`
            (0: all), drawn per sample after sampling, see [`mmgrpo.samplers.flow_plan.select_units`].
        unit_weighting (`str`): ``"uniform"`` or ``"latent_change"`` (a unit is drawn with probability proportional
            to the mean relative L1 change of the latent over its steps, Chunk-GRPO's weighted chunk sampling).
        solver (`str`): ``"flow"`` (Euler ODE / flow SDE steps) or, feature ``"dpm"``, ``"dpm"``: diffusers'
            `DPMSolverMultistepScheduler` configured for flow matching (deterministic; no SDE step allowed).
        flow_shift (`float`): the ``flow_shift`` of the ``"dpm"`` solver's noise levels.
        scoring (`str`): ``"trajectory"`` or, feature ``"likelihood"``, ``"likelihood"`` (the policy's
            ``likelihood`` scores the final samples at the noise levels of `train_units`).
        likelihood_noise (`str`): the noise ``eps`` of a likelihood's noised points: ``"group"`` (shared within a
            group, DGPO) or, feature ``"sample_noise"``, ``"sample"`` (each sample its own: DiffusionNFT, AWM); either
            way fixed by the plan's seed, so the policy, its old model and its reference score the same points.
        record_mean (`bool`): feature ``"old_mean"``: the rollout records the mean of every trained SDE transition
            (one latent per trained step and sample), which the replay returns as ``Score.old_mean`` (GRPO-Guard's
            RatioNorm, Flow-DPPO's divergence mask).
        tree_split_points (`list[int]`): feature ``"tree"`` (BranchGRPO): each group is a tree from one root noise;
            at each of these SDE steps every node splits into `branch_factor` children, so a group has
            ``branch_factor ** len(tree_split_points)`` leaves (its members, ``PromptBatch.member_ids`` giving each
            leaf's path); shared prefixes are computed once per node. See [`mmgrpo.samplers.flow_tree`].
        branch_factor (`int`): children per node at a split point.
        tree_split_noise_scale (`float`): the standard normal noise of a split step is multiplied by it, while the
            recorded log-probability keeps the transition's unscaled std (as BranchGRPO's code).
        dpm_post_ratio (`float`): feature ``"dpm_post"`` (MixGRPO-Flash) when > 0: the ODE after the last SDE step
            ``b`` is DPM-Solver++ on ``max(int(max((S - b) * ratio, 1)), 2)`` compressed noise levels ending at 0; see
            [`mmgrpo.samplers.flow_dpm.sample_post_dpm`]. A plan without SDE steps samples as without it.
        dpm_solver_type (`str`): the 2nd order DPM-Solver++ update of ``"dpm_post"``: ``"midpoint"`` or ``"heun"``.
    """

    family: ClassVar[str] = "flow"

    num_steps: int
    sde_steps: list[int]
    train_units: list[list[int]]
    noise_level: float = 0.7
    sde_type: str = "sde"
    merge: dict[int, int] = field(default_factory=dict)
    merge_entropy: float | None = None
    max_merge: int = 1
    branch: bool = False
    seed: int = 0
    init_same_noise: bool = False
    units_per_sample: int = 0
    unit_weighting: str = "uniform"
    solver: str = "flow"
    flow_shift: float = 3.0
    scoring: str = "trajectory"
    likelihood_noise: str = "group"
    record_mean: bool = False
    tree_split_points: list[int] = field(default_factory=list)
    branch_factor: int = 2
    tree_split_noise_scale: float = 1.0
    dpm_post_ratio: float = 0.0
    dpm_solver_type: str = "midpoint"

    def __post_init__(self):
        trained = self.trained_steps
        if self.scoring == "trajectory":
            bad = [s for s in trained if s not in self.sde_steps]
            if bad:
                raise ValueError(f"FlowPlan trains steps {bad} that are not stochastic (sde_steps={self.sde_steps}).")
        elif self.scoring == "likelihood":
            if any(not 0 <= s < self.num_steps for s in trained):
                raise ValueError(f"FlowPlan scores noise levels {trained} outside 0..{self.num_steps - 1}.")
        else:
            raise ValueError(f"FlowPlan.scoring must be 'trajectory' or 'likelihood', got {self.scoring!r}.")
        if self.solver not in ("flow", "dpm"):
            raise ValueError(f"FlowPlan.solver must be 'flow' or 'dpm', got {self.solver!r}.")
        if self.likelihood_noise not in ("group", "sample"):
            raise ValueError(f"FlowPlan.likelihood_noise must be 'group' or 'sample', got {self.likelihood_noise!r}.")
        if self.record_mean and self.scoring != "trajectory":
            raise ValueError("FlowPlan.record_mean records SDE transitions' means: it needs 'trajectory' scoring.")
        if self.solver == "dpm" and self.sde_steps:
            raise ValueError("The 'dpm' solver is deterministic: a plan using it cannot have sde_steps.")
        if self.unit_weighting not in ("uniform", "latent_change"):
            raise ValueError(f"unit_weighting must be 'uniform' or 'latent_change', got {self.unit_weighting!r}.")
        if not 0 <= self.units_per_sample <= len(self.train_units):
            raise ValueError(f"units_per_sample {self.units_per_sample} must be in 0..{len(self.train_units)}.")
        self._check_merges()
        self._check_tree()
        self._check_dpm_post()
        if self.branch and (not self.sde_steps or len(set(self.sde_steps)) != len(self.sde_steps)):
            raise ValueError(f"A branching plan needs distinct sde_steps (one per branch), got {self.sde_steps}.")
        if self.init_same_noise and (self.branch or self.tree_split_points):
            raise ValueError("FlowPlan.init_same_noise: a branching or tree plan already shares one initial noise per "
                             "group; leave init_same_noise off.")

    def _check_merges(self) -> None:
        if any(i not in self.sde_steps or m < 1 or i + m > self.num_steps for i, m in self.merge.items()):
            raise ValueError(
                f"FlowPlan.merge {self.merge}: each key must be an SDE step i and each value m >= 1 with "
                f"i + m <= num_steps ({self.num_steps})."
            )
        if self.max_merge < 1:
            raise ValueError(f"max_merge must be >= 1, got {self.max_merge}.")
        if not self.branch:  # one path for every sample: a merged step must not jump over another SDE step
            for i, m in self.merge.items():
                inside = [s for s in self.sde_steps if i < s < i + m]
                if inside:
                    raise ValueError(f"Merged step {i} (spanning {m} steps) jumps over SDE steps {inside}.")

    def _check_tree(self) -> None:
        points = self.tree_split_points
        if not points:
            return
        if points != sorted(set(points)) or any(p not in self.sde_steps for p in points):
            raise ValueError(f"FlowPlan.tree_split_points {points} must be increasing, distinct SDE steps "
                             f"(sde_steps={self.sde_steps}).")
        if self.branch_factor < 2 or not self.tree_split_noise_scale > 0:
            raise ValueError(f"A tree plan needs branch_factor >= 2 and tree_split_noise_scale > 0, got "
                             f"{self.branch_factor} and {self.tree_split_noise_scale}.")
        if self.branch or self.merge or self.merge_entropy is not None or self.solver != "flow" or \
                self.scoring != "trajectory" or self.units_per_sample or self.record_mean:
            raise ValueError("A tree plan (tree_split_points) combines with no other flow plan feature.")

    def _check_dpm_post(self) -> None:
        if not 0 <= self.dpm_post_ratio <= 1 or self.dpm_solver_type not in ("midpoint", "heun"):
            raise ValueError(f"FlowPlan.dpm_post_ratio must be in [0, 1] and dpm_solver_type 'midpoint' or 'heun', got "
                             f"{self.dpm_post_ratio} and {self.dpm_solver_type!r}.")
        if not self.dpm_post_ratio:
            return
        if self.sde_steps and max(self.sde_steps) > self.num_steps - 2:
            raise ValueError(f"FlowPlan.dpm_post_ratio: the DPM-Solver++ part needs an ODE step after the last SDE "
                             f"step (sde_steps={self.sde_steps}, num_steps={self.num_steps}).")
        if self.branch or self.merge or self.merge_entropy is not None or self.solver != "flow" or \
                self.scoring != "trajectory" or self.units_per_sample or self.tree_split_points:
            raise ValueError("FlowPlan.dpm_post_ratio combines only with init_same_noise and record_mean.")

    @property
    def tree_leaves(self) -> int:
        """Leaves of a tree plan's group, ``branch_factor ** len(tree_split_points)`` (1 without a tree)."""
        return self.branch_factor ** len(self.tree_split_points)

    def features(self) -> set[str]:
        """The opt-in features this plan uses, a subset of [`FLOW_PLAN_FEATURES`]: ``"merge"`` (fixed or
        entropy-adaptive merged SDE steps), ``"branch"`` (group branches from one anchor), ``"unit_selection"``
        (per-sample trained units), ``"dpm"`` (the DPM-Solver++ rollout) and ``"likelihood"`` (scoring by
        [`mmgrpo.samplers.flow_likelihood.plan_likelihood`]), ``"tree"`` (BranchGRPO's tree rollout) and ``"dpm_post"``
        (DPM-Solver++ after the SDE steps); a policy must list them all in its ``plan_features``."""
        used = {
            "merge": bool(self.merge) or self.merge_entropy is not None,
            "branch": self.branch,
            "init_same_noise": self.init_same_noise,
            "unit_selection": self.units_per_sample > 0,
            "dpm": self.solver == "dpm",
            "likelihood": self.scoring == "likelihood",
            "sample_noise": self.likelihood_noise == "sample",
            "old_mean": self.record_mean,
            "tree": bool(self.tree_split_points),
            "dpm_post": self.dpm_post_ratio > 0,
        }
        return {name for name, on in used.items() if on}

    @property
    def trained_steps(self) -> list[int]:
        return [s for unit in self.train_units for s in unit]

    @classmethod
    def deterministic(cls, num_steps: int) -> "FlowPlan":
        """An ODE plan (no stochastic step, nothing trained), used for evaluation."""
        return cls(num_steps=num_steps, sde_steps=[], train_units=[], noise_level=0.0)


@dataclass
class TokenPlan:
    """A token-decoding plan (family ``"token"``, emitted by the token algorithms `grpo`, `dr_grpo`, `dapo`, `gspo`,
    `sapo`): every decision samples unless the plan is greedy, and the trained decisions form `train_units`. The
    sampling distribution itself (temperature, top-p, top-k) is the pipeline's option, since its scores use it too.

    Args:
        num_steps (`int`): decisions `S` (tokens, or decoding steps of a masked-diffusion LM).
        train_units (`list[list[int]]`): the trained decisions, grouped into units scored together.
        greedy (`bool`): decode deterministically (argmax; a masked-diffusion LM: its evaluation temperature).
        seed (`int`): seed shared by every process (unused by plain decoding).
        ground_truth_member (`bool`): feature ``"ground_truth_member"`` (TempSamp-R1's off-policy member): member 0 of
            each group (``PromptBatch.member_ids``) decodes its prompt's ground-truth completion,
            ``metadata["completion"]``, teacher-forced instead of sampled, and is scored like the others.
    """

    family: ClassVar[str] = "token"
    scoring: ClassVar[str] = "trajectory"
    num_steps: int
    train_units: list[list[int]]
    greedy: bool = False
    seed: int = 0
    ground_truth_member: bool = False

    def __post_init__(self):
        check_units(self)

    def features(self) -> set[str]:
        """The opt-in features this plan uses (``{"ground_truth_member"}`` or none)."""
        return {"ground_truth_member"} if self.ground_truth_member else set()

    @property
    def trained_steps(self) -> list[int]:
        return [s for unit in self.train_units for s in unit]

    @classmethod
    def deterministic(cls, num_steps: int) -> "TokenPlan":
        """Greedy decoding, nothing trained: evaluation."""
        return cls(num_steps=num_steps, train_units=[], greedy=True)


@dataclass
class MaskedPlan:
    """A masked-diffusion decoding plan (family ``"masked"``, emitted by `cj_grpo` and `diffu_grpo`): which decoding
    steps are trained and how they are scored. The decoding itself (blocks, remasking, EOSER, ASS, temperatures) is
    the pipeline's option, since replay must decode exactly as the rollout did.

    Args:
        num_steps (`int`): decoding steps `S`.
        train_units (`list[list[int]]`): with ``"trajectory"`` scoring, the replayed steps, one unit each; with
            ``"likelihood"`` scoring, indices of the one-step likelihood draws.
        greedy (`bool`): decode at the pipeline's evaluation temperature instead of its sampling temperature.
        seed (`int`): seed of the likelihood draws' prompt masks, the same on every process.
        scoring (`str`): ``"trajectory"`` or, feature ``"likelihood"``, ``"likelihood"``.
        token_scores (`bool`): feature ``"token_scores"``: the loss needs per-token scores of each step
            (``token_log_prob``, ``token_mask``, ``old_token_log_prob``).
        likelihood (`str`): with ``"likelihood"`` scoring, the estimator: ``"one_step"`` (d1's one-step estimate) or,
            feature ``"elbo"``, ``"elbo"`` (GDPO's semi-deterministic Monte Carlo ELBO of the whole completion).
        elbo_convention (`str`): with ``likelihood="elbo"``, the positions the ELBO scores and how masks are counted:
            ``"to_first_eos"`` (the tokens up to and including the first EOS; a mask of ``round(t L_y)``, at least 1,
            weighted ``L_y / k``) or ``"full_width"`` (every completion position; ``floor(t W)`` positions, weighted
            ``1 / t``: GDPO's released code). See `pipelines/_mdlm_elbo.py`.
    """

    family: ClassVar[str] = "masked"
    num_steps: int
    train_units: list[list[int]]
    greedy: bool = False
    seed: int = 0
    scoring: str = "trajectory"
    token_scores: bool = False
    likelihood: str = "one_step"
    elbo_convention: str = "to_first_eos"

    def __post_init__(self):
        if self.scoring not in ("trajectory", "likelihood"):
            raise ValueError(f"MaskedPlan.scoring must be 'trajectory' or 'likelihood', got {self.scoring!r}.")
        if self.likelihood not in ("one_step", "elbo"):
            raise ValueError(f"MaskedPlan.likelihood must be 'one_step' or 'elbo', got {self.likelihood!r}.")
        if self.elbo_convention not in ("to_first_eos", "full_width"):
            raise ValueError(f"MaskedPlan.elbo_convention must be 'to_first_eos' or 'full_width', "
                             f"got {self.elbo_convention!r}.")
        check_units(self)

    def features(self) -> set[str]:
        """The opt-in features this plan uses (a subset of ``{"likelihood", "elbo", "token_scores"}``)."""
        likelihood = self.scoring == "likelihood"
        return {name for name, on in (("likelihood", likelihood), ("elbo", likelihood and self.likelihood == "elbo"),
                                      ("token_scores", self.token_scores)) if on}

    @property
    def trained_steps(self) -> list[int]:
        return [s for unit in self.train_units for s in unit]

    @classmethod
    def deterministic(cls, num_steps: int) -> "MaskedPlan":
        """Decoding at the evaluation temperature, nothing trained: evaluation."""
        return cls(num_steps=num_steps, train_units=[], greedy=True)


def check_units(plan) -> None:
    """The trained decisions of a token or masked plan lie in ``0 .. num_steps - 1``."""
    outside = [s for s in plan.trained_steps if not 0 <= s < plan.num_steps]
    if plan.num_steps < 1 or outside:
        raise ValueError(f"{type(plan).__name__} of {plan.num_steps} steps trains steps {outside} outside 0..num_steps-1.")


SamplingPlan = Union[FlowPlan, TokenPlan, MaskedPlan]  # what `algorithm.schedule` returns and `policy.sample` reads
PLAN_TYPES = {plan.family: plan for plan in (FlowPlan, TokenPlan, MaskedPlan)}  # family -> plan type


def deterministic_plan(family: str, num_steps: int) -> SamplingPlan:
    """The evaluation plan of a plan `family` (no stochastic step, nothing trained), over `num_steps` decisions."""
    if family not in PLAN_TYPES:
        raise ValueError(f"Unknown plan family {family!r}: use one of {sorted(PLAN_TYPES)}.")
    return PLAN_TYPES[family].deterministic(num_steps)
