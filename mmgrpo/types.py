"""Typed records passed between the trainer, pipelines, rewards and algorithms.

Shape letters: ``B`` prompts, ``G`` group size, ``N = B * G`` samples, ``S`` decisions (denoising steps or
tokens), ``C/H/W`` channels and pixels.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Literal

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
        engine_log_probs (`torch.FloatTensor` of shape `[N, S]`, *optional*): the log-probs an engine other than the
            trainer's forward reported for the sampled transitions (then also `old_log_probs` until the trainer's
            rollout correction recomputes those, see [`mmgrpo.rollout_correction`]); `None` for the local engine.
        is_weights (`torch.FloatTensor` of shape `[N, S]`, *optional*): the rollout correction's importance weights,
            which the token losses multiply into each transition's policy term.
    """

    group_ids: torch.Tensor  # [N]
    outputs: dict[str, Any]
    old_log_probs: torch.Tensor  # [N, S]
    mask: torch.Tensor  # [N, S] bool
    trajectory: dict[str, Any] = field(default_factory=dict)
    engine_log_probs: torch.Tensor | None = None  # [N, S]
    is_weights: torch.Tensor | None = None  # [N, S]

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
            engine_log_probs=None if self.engine_log_probs is None else self.engine_log_probs[index],
            is_weights=None if self.is_weights is None else self.is_weights[index],
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
        scores_are_advantages (`bool`, defaults to `False`): the scores are already the advantages of the whole batch
            (a group stage that ends in the advantage step itself, e.g. TRL's ``normalize_then_sum`` in `composite`):
            the trainer uses them as they are (NaN: advantage 0, not scored) instead of ``algorithm.advantages``
            ([`mmgrpo.advantages.reward_advantages`]).
        artifacts (`dict[str, list]`): what the reward adds for the sample writers, by artifact kind, each a list of
            `N` per-sample values (`None`: nothing for that sample); exactly the kinds its class declares for its
            options (``artifacts_for``, see [`mmgrpo.protocols.RewardFn`]), e.g. ``"mask"`` (bool `[H, W]` masks) and
            ``"seg_prompts"`` (``{"boxes", "points", "labels"}``) of `sam_mask`. They stay in the process that scored
            (the writers keep each process's own samples): never gathered, never sent by the reward server.
    """

    scores: torch.Tensor  # [N] float32
    components: dict[str, torch.Tensor] = field(default_factory=dict)  # name -> [N]
    features: torch.Tensor | None = None  # [N, ...]
    scores_are_advantages: bool = False
    artifacts: dict[str, list] = field(default_factory=dict)  # kind -> N per-sample values


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
        old_mean (`torch.FloatTensor` of shape `[n, k, ...]`, *optional*): `mean` under the sampling policy, recorded
            at sampling for the plans that ask for it (flow plan feature ``"old_mean"``: GRPO-Guard's RatioNorm,
            Flow-DPPO's divergence mask); no gradient.
        velocity (`torch.FloatTensor` of shape `[n, k, ...]`, *optional*): the model's velocity at each scored noise
            level of a flow likelihood (latent shape), for a velocity-space KL.
        target (`torch.FloatTensor` of shape `[n, k, ...]`, *optional*): the flow-matching target ``eps - x0`` of each
            scored noise level of a flow likelihood (no gradient), so a loss can work in x0-space:
            ``x0_hat - x0 = sigma * (target - v)`` (DiffusionNFT).
        sigma (`torch.FloatTensor` of shape `[n, k]`, *optional*): the noise level ``s`` of each scored point
            ``x_s = (1 - s) x0 + s eps`` of a flow likelihood (AWM's time weighting, DiffusionNFT's x0 prediction).
        group_ids (`torch.LongTensor` of shape `[n]`, *optional*): the group of each sample (a likelihood's
            group-shared noise), for losses that weigh groups.
        token_log_prob (`torch.FloatTensor` of shape `[n, k, L]`, *optional*): per-token log-probs of each scored step
            of a masked-diffusion LM, `L` the completion length, with gradients.
        token_mask (`torch.BoolTensor` of shape `[n, k, L]`, *optional*): the tokens each scored step scores.
        old_token_log_prob (`torch.FloatTensor` of shape `[n, k, L]`, *optional*): `token_log_prob` of the sampling
            policy, recorded at sampling (no gradient).
        is_weight (`torch.FloatTensor` of shape `[n, k]`, *optional*): the rollout correction's importance weight of
            each entry (``Rollout.is_weights``; no gradient), set by the trainer, never by a pipeline.
    """

    log_prob: torch.Tensor  # [n, k]
    mask: torch.Tensor | None = None  # [n, k] bool
    mean: torch.Tensor | None = None  # [n, k, ...]
    std: torch.Tensor | None = None  # [n, k, 1, ...]
    noise_scale: torch.Tensor | None = None  # [n, k, 1, ...]
    old_mean: torch.Tensor | None = None  # [n, k, ...]
    velocity: torch.Tensor | None = None  # [n, k, ...]
    target: torch.Tensor | None = None  # [n, k, ...]
    sigma: torch.Tensor | None = None  # [n, k]
    group_ids: torch.Tensor | None = None  # [n] long
    token_log_prob: torch.Tensor | None = None  # [n, k, L]
    token_mask: torch.Tensor | None = None  # [n, k, L] bool
    old_token_log_prob: torch.Tensor | None = None  # [n, k, L]
    is_weight: torch.Tensor | None = None  # [n, k]

    @classmethod
    def field_names(cls) -> frozenset[str]:
        """Every field a pipeline may provide and an algorithm may read."""
        return frozenset(f.name for f in fields(cls))

    def provided(self) -> frozenset[str]:
        """The fields that are not `None`."""
        values = vars(self)  # the fields' values by name
        return frozenset(f.name for f in fields(self) if values[f.name] is not None)


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
        drop_zero_advantage (`bool`): Flow-GRPO's filter: each process leaves its samples with advantage exactly 0 out
            of its batch before cutting it into minibatches, whose number stays while they shrink, so a minibatch's
            loss is the mean over its kept samples (see [`~mmgrpo.advantages.kept_samples`]). Unlike
            `zero_advantage_is_inert`, this changes the gradient (the kept samples weigh more), KL term included.
        has_state (`bool`): the algorithm keeps state of its own besides its KL weight (DGPO's fast-EMA old model) and
            has ``state_dict() -> dict`` and ``load_state_dict(state)``; checkpoints save and restore it. (The KL
            weight, the ``kl`` member every algorithm has, is stepped and checkpointed by the trainer in any case.)
        after_update (`bool`): the algorithm has an ``after_update(policy)`` hook, which the trainer calls after every
            optimizer update taken (DGPO's old model follows the weights).
        after_step (`bool`): the algorithm has an ``after_step()`` hook, which the trainer calls once at the end of
            every training step (one rollout), whether or not it took an update (MixGRPO's sliding window counts the
            rollout iterations); checkpoint what it counts through ``has_state``.
        schedule_reads_state (`bool`): ``schedule`` reads the algorithm's own state (MixGRPO's progressive window
            reads its count of training steps), so a step's plan is known only once the step before it ended:
            ``train.async`` with a staleness above 0, which plans steps ahead, refuses it.
        old_source (`str`): what the loss gets as `old_log_prob` `[n, k]`, the "old" policy of its ratio:

            - ``"rollout"``: the log-probs the rollout recorded at sampling (``Rollout.old_log_probs``), the policy
              that sampled (PPO's old policy; every replayed-trajectory algorithm).
            - ``"old_model"``: the `log_prob` of the score under an old model the algorithm keeps itself: the trainer
              scores the unit, without gradients, inside the algorithm's ``old_policy(policy)`` context (DGPO's fast
              EMA of the weights), which the algorithm then must have.
            - ``"current"``: the current score's `log_prob`, detached, with no extra forward (the ratio is 1: the
              loss reads no old model this run, e.g. DGPO without its clip or EMA reference).
        old_score (`bool`): the loss gets the old policy's whole [`Score`] as `old_log_prob` instead of its `log_prob`
            alone (DiffusionNFT's implicit policies and AWM's EMA KL read the old model's ``velocity`` at the same
            noised points): with ``old_source="old_model"`` the score of the algorithm's old model, with ``"current"``
            the current score with every tensor detached (no extra forward). Refused with ``"rollout"``.
        update_mean (`str`): how the losses of one optimizer update's passes (minibatch x unit) are combined:

            - ``"samples"``: each pass's loss weighs its share of the update's samples, each unit alike (a mean over
              samples of the per-sample losses).
            - ``"entries"``: every entry the losses average over (a token, a (sample, chunk) pair) weighs the same
              across the whole update: the loss reports its count in ``LossOutput.entries``; the trainer weights each
              pass by it and divides the update's gradient by the count over all passes and processes (DAPO's token
              mean over the update; GCPO's mean over the trained (sample, chunk) pairs).
            - ``"rollout_entries"``: as ``"entries"``, but every update's gradient is divided by the count of the whole
              rollout batch (one inner epoch, all processes, divided by their number), the same for every update (TRL's
              ``loss_type="dapo"``). A sample's entries are then its trained decisions, ``Rollout.mask`` over the
              plan's train units, counted for every sample, which the loss's ``entries`` must count alike.
        group_local_advantages (`bool`): each sample's advantage depends on its own group's scores only, so a process
            holding whole groups can compute them alone (``train.group_placement: contiguous``); `False` when they
            read the whole batch (a batch standard deviation: ``scale_rewards: batch``).
        step_advantages (`bool`): the advantage depends on the step (BranchGRPO's depth-wise advantages): the algorithm
            has ``step_advantages(scores, group_ids, member_ids, plan, log_probs) -> [N, S]``, each sample's advantage
            at each of the plan's `S` steps (`member_ids` `[N]`: each sample's index in its group,
            ``PromptBatch.member_ids``; `log_probs` `[N, S]`: the rollout's ``old_log_probs`` of the same samples),
            which the trainer calls instead of ``advantages`` and slices: ``loss`` gets the scored unit's columns,
            `[n, k]`, NaN where the algorithm leaves a transition untrained (BranchGRPO's width pruning). A sample has
            signal when any of its entries is non-zero.
        selects_samples (`bool`): the algorithm has ``select_samples(advantages [N], group_ids [N]) -> [N]``, which
            [`~mmgrpo.advantages.reward_advantages`] applies to the batch's advantages (also to a reward's own,
            ``scores_are_advantages``): the samples it leaves out of training get advantage 0 (DanceGRPO's best-of-N);
            with `drop_zero_advantage` they leave the batch.
        ground_truth_member (`bool`): member 0 of each group is not sampled but teacher-forced on its prompt's ground
            truth (TempSamp-R1's off-policy member; its plans' ``ground_truth_member``, which the checks before any
            model loads compare with this): the trainer also logs ``reward/sampled_mean``, the mean reward of the
            other, sampled members.
        rollout_correction (`RolloutCorrectionOptions`, *optional*): the algorithm's rollout correction options (see
            [`mmgrpo.rollout_correction`]): its loss multiplies ``Score.is_weight`` into each entry's policy term. `None`:
            it takes no rollout whose engine's log-probs differ from the trainer's.
    """

    reads: frozenset[str] = frozenset({"log_prob"})
    needs_reference: bool = False
    zero_advantage_is_inert: bool = False
    drop_zero_advantage: bool = False
    has_state: bool = False
    after_update: bool = False
    after_step: bool = False
    schedule_reads_state: bool = False
    old_source: Literal["rollout", "old_model", "current"] = "rollout"
    old_score: bool = False
    update_mean: Literal["samples", "entries", "rollout_entries"] = "samples"
    group_local_advantages: bool = True
    ground_truth_member: bool = False
    step_advantages: bool = False
    selects_samples: bool = False
    rollout_correction: Any = None  # a RolloutCorrectionOptions: the algorithm applies rollout correction

    def __post_init__(self):
        if self.update_mean not in ("samples", "entries", "rollout_entries"):
            raise ValueError(f"AlgorithmTraits.update_mean must be 'samples', 'entries' or 'rollout_entries', got "
                             f"{self.update_mean!r}.")
        if self.old_source not in ("rollout", "old_model", "current"):
            raise ValueError(f"AlgorithmTraits.old_source must be 'rollout', 'old_model' or 'current', got "
                             f"{self.old_source!r}.")
        if self.old_score and self.old_source == "rollout":
            raise ValueError("AlgorithmTraits.old_score passes the old model's whole Score, which a rollout does not "
                             "record: use old_source 'old_model' or 'current'.")
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
