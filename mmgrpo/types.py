"""Typed records passed between the trainer, pipelines, rewards and algorithms.

Shape letters: ``B`` prompts, ``G`` group size, ``N = B * G`` samples, ``S`` decisions (denoising steps or
tokens), ``C/H/W`` channels and pixels.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, Literal, Union

import torch


def as_list(value) -> list:
    """One item's condition as a list: ``None`` -> ``[]``, a list or tuple -> a list, anything else -> ``[value]``
    (a prompt may carry one image or several)."""
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]


@dataclass
class PromptBatch:
    """A batch of prompts, with what the reward needs to score the outputs.

    Args:
        prompts (`list[str]`): the text prompts, length `N` after [`~PromptBatch.repeat`].
        metadata (`list[dict]`): one dictionary per prompt (ground truth, task tags...), length `N`.
        group_ids (`torch.LongTensor` of shape `[N]`, *optional*): which group each sample belongs to; samples
            of the same prompt share an id. Ids are global: the same id on two ranks is the same group.
        conditions (`dict`, *optional*): per-item conditioning inputs (images, videos...), each a list of length `N`.
        member_ids (`torch.LongTensor` of shape `[N]`, *optional*): position of each sample inside its group
            (``0 .. G - 1``), set by [`~PromptBatch.repeat`]; plans that treat group members differently (branches)
            key on it, so it stays right when a group spans processes.
    """

    prompts: list[str]
    metadata: list[dict] = field(default_factory=list)
    group_ids: torch.Tensor | None = None  # [N] long
    conditions: dict[str, list[Any]] = field(default_factory=dict)
    member_ids: torch.Tensor | None = None  # [N] long

    def __post_init__(self):
        if not self.metadata:
            self.metadata = [{} for _ in self.prompts]
        if len(self.metadata) != len(self.prompts):
            raise ValueError(f"PromptBatch has {len(self.prompts)} prompts but {len(self.metadata)} metadata entries.")

    def __len__(self) -> int:
        return len(self.prompts)

    def repeat(self, group_size: int, first_group_id: int = 0) -> "PromptBatch":
        """Repeats each prompt `group_size` times in a row and numbers the groups from `first_group_id`."""
        index = [i for i in range(len(self)) for _ in range(group_size)]
        return PromptBatch(
            prompts=[self.prompts[i] for i in index],
            metadata=[self.metadata[i] for i in index],
            group_ids=torch.tensor(index, dtype=torch.long) + first_group_id,
            conditions={k: [v[i] for i in index] for k, v in self.conditions.items()},
            member_ids=torch.arange(group_size).repeat(len(self)),
        )

    def select(self, index: list[int] | torch.Tensor) -> "PromptBatch":
        """Returns the sub-batch at `index` (used to split a batch across ranks or minibatches)."""
        index = [int(i) for i in index]
        return PromptBatch(
            prompts=[self.prompts[i] for i in index],
            metadata=[self.metadata[i] for i in index],
            group_ids=None if self.group_ids is None else self.group_ids[index],
            conditions={k: [v[i] for i in index] for k, v in self.conditions.items()},
            member_ids=None if self.member_ids is None else self.member_ids[index],
        )


@dataclass
class Rollout:
    """What a policy sampled, with everything needed to replay and re-score the same transitions.

    Args:
        group_ids (`torch.LongTensor` of shape `[N]`): group of each sample (copied from the prompt batch).
        outputs (`dict`): decoded outputs for rewards, e.g. ``{"images": FloatTensor [N, 3, H, W] in [0, 1]}``.
        old_log_probs (`torch.FloatTensor` of shape `[N, S]`): log-probabilities of the sampled transitions.
        mask (`torch.BoolTensor` of shape `[N, S]`): which transitions are trained (e.g. SDE steps of a window).
        trajectory (`dict`): adapter-private replay state (latents per step, sigmas, prompt embeddings...).
            Algorithms never look inside it; every tensor in it has `N` as first dimension unless its key
            starts with ``shared_``.
    """

    group_ids: torch.Tensor  # [N]
    outputs: dict[str, Any]
    old_log_probs: torch.Tensor  # [N, S]
    mask: torch.Tensor  # [N, S] bool
    trajectory: dict[str, Any] = field(default_factory=dict)

    def __len__(self) -> int:
        return self.old_log_probs.shape[0]

    def select(self, index: torch.Tensor) -> "Rollout":
        """Returns the samples at `index` (a minibatch); ``shared_*`` trajectory entries are kept whole."""

        def pick(value):
            if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == len(self):
                return value[index]
            if isinstance(value, list) and len(value) == len(self):
                return [value[int(i)] for i in index]
            return value

        return Rollout(
            group_ids=self.group_ids[index],
            outputs={k: pick(v) for k, v in self.outputs.items()},
            old_log_probs=self.old_log_probs[index],
            mask=self.mask[index],
            trajectory={k: (v if k.startswith("shared_") else pick(v)) for k, v in self.trajectory.items()},
        )


@dataclass
class RewardResult:
    """Scores of a batch of outputs.

    Args:
        scores (`torch.FloatTensor` of shape `[N]`): the reward; NaN means "not applicable" and is excluded
            from group statistics (never silently 0).
        components (`dict[str, torch.FloatTensor]`): named per-sample parts of the reward, each `[N]`, logged.
        features (`torch.FloatTensor` of shape `[N, ...]`, *optional*): per-sample features that the reward's group
            stage reads besides the scores (e.g. embeddings for a set-level diversity score); gathered from every
            process like the scores, never logged. See [`mmgrpo.protocols.RewardFn`].
    """

    scores: torch.Tensor  # [N] float32
    components: dict[str, torch.Tensor] = field(default_factory=dict)  # name -> [N]
    features: torch.Tensor | None = None  # [N, ...]


@dataclass
class Score:
    """A policy's score of `k` trained decisions of `n` samples: what ``policy.log_prob`` (replay of the sampled
    transitions) and ``policy.likelihood`` (a sample-only surrogate) return and ``algorithm.loss`` reads.

    Only `log_prob` is always there; a field a pipeline has no such thing for is `None`. A pipeline declares which
    fields each scoring method fills (``provides``), an algorithm which ones its loss reads (``traits.reads``), and
    the trainer refuses a pair that does not match before any model loads.

    Args:
        log_prob (`torch.FloatTensor` of shape `[n, k]`): log-probability of each scored decision, with gradients (a
            likelihood's surrogate: minus the flow-matching loss, or a one-step token log-prob sum).
        mask (`torch.BoolTensor` of shape `[n, k]`, *optional*): the entries that are trained decisions of that sample;
            the others are placeholders (log-prob 0, no gradient) that a loss must ignore.
        mean (`torch.FloatTensor` of shape `[n, k, ...]`, *optional*): mean of each flow SDE transition (latent shape),
            for a KL to the reference.
        std (`torch.FloatTensor` of shape `[n, k, 1, ...]`, *optional*): std of each flow SDE transition (0 where the
            step is deterministic or a placeholder), broadcastable to `mean`.
        noise_scale (`torch.FloatTensor` of shape `[n, k, 1, ...]`, *optional*): the flow SDE's noise scale at each
            step, ``sigma_t`` with ``std = sigma_t * sqrt(|dt|)`` (Flow-GRPO's ``std_dev_t``; equal to `std` for CPS),
            for KL conventions that divide by ``sigma_t^2``.
        velocity (`torch.FloatTensor` of shape `[n, k, ...]`, *optional*): the model's velocity at each scored noise
            level of a flow likelihood (latent shape), for a velocity-space KL.
        group_ids (`torch.LongTensor` of shape `[n]`, *optional*): the group of each sample (a likelihood's
            group-shared noise), for losses that weigh groups.
        token_log_prob (`torch.FloatTensor` of shape `[n, k, L]`, *optional*): per-token log-probs of each scored step
            of a masked-diffusion LM, `L` the completion length, with gradients.
        token_mask (`torch.BoolTensor` of shape `[n, k, L]`, *optional*): the tokens each scored step scores.
        old_token_log_prob (`torch.FloatTensor` of shape `[n, k, L]`, *optional*): `token_log_prob` of the sampling
            policy, recorded at sampling (no gradient).
    """

    log_prob: torch.Tensor  # [n, k]
    mask: torch.Tensor | None = None  # [n, k] bool
    mean: torch.Tensor | None = None  # [n, k, ...]
    std: torch.Tensor | None = None  # [n, k, 1, ...]
    noise_scale: torch.Tensor | None = None  # [n, k, 1, ...]
    velocity: torch.Tensor | None = None  # [n, k, ...]
    group_ids: torch.Tensor | None = None  # [n] long
    token_log_prob: torch.Tensor | None = None  # [n, k, L]
    token_mask: torch.Tensor | None = None  # [n, k, L] bool
    old_token_log_prob: torch.Tensor | None = None  # [n, k, L]

    @classmethod
    def field_names(cls) -> frozenset[str]:
        """Every field a pipeline may provide and an algorithm may read."""
        return frozenset(f.name for f in fields(cls))

    def provided(self) -> frozenset[str]:
        """The fields that are not `None`."""
        return frozenset(f.name for f in fields(self) if getattr(self, f.name) is not None)


@dataclass(frozen=True)
class AlgorithmTraits:
    """What an algorithm asks of the trainer and of the pipeline, declared in one record (the trainer never probes an
    algorithm for optional members). Each algorithm builds its own from its options, as ``self.traits``.

    Args:
        reads (`frozenset[str]`): the [`Score`] fields its loss reads, of the policy's score and of the reference's
            (a subset of [`Score.field_names`]). The trainer refuses, before any model loads, a pipeline whose scoring
            method does not provide one of them (see the pipeline's ``provides``).
        needs_reference (`bool`): the loss reads the frozen reference policy's score (`ref`; a KL term, DGPO's
            preference); otherwise the trainer skips the reference forward and passes `ref=None`.
        zero_advantage_is_inert (`bool`): a sample with advantage 0 adds exactly nothing to the loss's gradient (e.g.
            no KL term), so the trainer does not score the members of groups whose advantages are all 0.
        has_state (`bool`): the algorithm keeps state of its own (DGPO's fast-EMA old model) and has
            ``state_dict() -> dict`` and ``load_state_dict(state)``; checkpoints save and restore it.
        after_update (`bool`): the algorithm has an ``after_update(policy)`` hook, which the trainer calls after every
            optimizer update taken (DGPO's old model follows the weights).
        old_source (`str`): what the loss gets as `old_log_prob` `[n, k]`, the "old" policy of its ratio:

            - ``"rollout"``: the log-probs the rollout recorded at sampling (``Rollout.old_log_probs``), the policy
              that sampled (PPO's old policy; every replayed-trajectory algorithm).
            - ``"old_model"``: the `log_prob` of the score under an old model the algorithm keeps itself: the trainer
              scores the unit, without gradients, inside the algorithm's ``old_policy(policy)`` context (DGPO's fast
              EMA of the weights), which the algorithm then must have.
            - ``"current"``: the current score's `log_prob`, detached, with no extra forward (the ratio is 1: the
              loss reads no old model this run, e.g. DGPO without its clip or EMA reference).
        update_mean (`str`): how the losses of one optimizer update's passes (minibatch x unit) are combined:

            - ``"samples"``: each pass's loss weighs its share of the update's samples, each unit alike (a mean over
              samples of the per-sample losses).
            - ``"entries"``: every entry the losses average over (a token, a (sample, chunk) pair) weighs the same
              across the whole update: the loss reports its count in ``LossOutput.entries``; the trainer weights each
              pass by it and divides the update's gradient by the count over all passes and processes (DAPO's token
              mean over the update; GCPO's mean over the trained (sample, chunk) pairs).
        group_local_advantages (`bool`): each sample's advantage depends on its own group's scores only, so a process
            holding whole groups can compute them alone (``train.group_placement: contiguous``); `False` when they
            read the whole batch (a batch standard deviation: ``global_std``, ``scale_rewards: batch``).
    """

    reads: frozenset[str] = frozenset({"log_prob"})
    needs_reference: bool = False
    zero_advantage_is_inert: bool = False
    has_state: bool = False
    after_update: bool = False
    old_source: Literal["rollout", "old_model", "current"] = "rollout"
    update_mean: Literal["samples", "entries"] = "samples"
    group_local_advantages: bool = True

    def __post_init__(self):
        if self.update_mean not in ("samples", "entries"):
            raise ValueError(f"AlgorithmTraits.update_mean must be 'samples' or 'entries', got {self.update_mean!r}.")
        if self.old_source not in ("rollout", "old_model", "current"):
            raise ValueError(f"AlgorithmTraits.old_source must be 'rollout', 'old_model' or 'current', got "
                             f"{self.old_source!r}.")
        unknown = sorted(set(self.reads) - Score.field_names())
        if unknown:
            raise ValueError(f"AlgorithmTraits.reads names {unknown}, which are not Score fields: use some of "
                             f"{sorted(Score.field_names())}.")
        object.__setattr__(self, "reads", frozenset(self.reads))


@dataclass
class LossOutput:
    """A scalar loss and the metrics to log with it (clip fraction, approx KL, ratio mean...)."""

    loss: torch.Tensor  # [] scalar with grad
    # with ``traits.update_mean == "entries"``: how many entries (tokens, (sample, chunk) pairs) `loss` averages over
    entries: float | None = None
    metrics: dict[str, float] = field(default_factory=dict)


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
        units_per_sample (`int`): feature ``"unit_selection"``: each sample trains only this many of `train_units`
            (0: all), drawn per sample after sampling, see [`mmgrpo.samplers.flow_plan.select_units`].
        unit_weighting (`str`): ``"uniform"`` or ``"latent_change"`` (a unit is drawn with probability proportional
            to the mean relative L1 change of the latent over its steps, Chunk-GRPO's weighted chunk sampling).
        solver (`str`): ``"flow"`` (Euler ODE / flow SDE steps) or, feature ``"dpm"``, ``"dpm"``: diffusers'
            `DPMSolverMultistepScheduler` configured for flow matching (deterministic; no SDE step allowed).
        flow_shift (`float`): the ``flow_shift`` of the ``"dpm"`` solver's noise levels.
        scoring (`str`): ``"trajectory"`` or, feature ``"likelihood"``, ``"likelihood"`` (the policy's
            ``likelihood`` scores the final samples at the noise levels of `train_units`).
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
    units_per_sample: int = 0
    unit_weighting: str = "uniform"
    solver: str = "flow"
    flow_shift: float = 3.0
    scoring: str = "trajectory"

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
        if self.solver == "dpm" and self.sde_steps:
            raise ValueError("The 'dpm' solver is deterministic: a plan using it cannot have sde_steps.")
        if self.unit_weighting not in ("uniform", "latent_change"):
            raise ValueError(f"unit_weighting must be 'uniform' or 'latent_change', got {self.unit_weighting!r}.")
        if not 0 <= self.units_per_sample <= len(self.train_units):
            raise ValueError(f"units_per_sample {self.units_per_sample} must be in 0..{len(self.train_units)}.")
        self._check_merges()
        if self.branch and (not self.sde_steps or len(set(self.sde_steps)) != len(self.sde_steps)):
            raise ValueError(f"A branching plan needs distinct sde_steps (one per branch), got {self.sde_steps}.")

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

    def features(self) -> set[str]:
        """The opt-in features this plan uses (a subset of ``{"merge", "branch", "unit_selection", "dpm",
        "likelihood"}``); a policy must list them all in its ``plan_features``. Read by
        [`mmgrpo.samplers.flow_plan.features`], beside the code that implements them."""
        from .samplers.flow_plan import features

        return features(self)

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
    """

    family: ClassVar[str] = "masked"
    num_steps: int
    train_units: list[list[int]]
    greedy: bool = False
    seed: int = 0
    scoring: str = "trajectory"
    token_scores: bool = False
    likelihood: str = "one_step"

    def __post_init__(self):
        if self.scoring not in ("trajectory", "likelihood"):
            raise ValueError(f"MaskedPlan.scoring must be 'trajectory' or 'likelihood', got {self.scoring!r}.")
        if self.likelihood not in ("one_step", "elbo"):
            raise ValueError(f"MaskedPlan.likelihood must be 'one_step' or 'elbo', got {self.likelihood!r}.")
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
