"""The four plugin contracts: a pipeline is a `StochasticPolicy`, a reward is a `RewardFn`, an algorithm is an
`Algorithm`, a prompt source is a `PromptSource`. Plugins implement them structurally (no inheritance); each plugin
module exposes its class as ``PLUGIN``."""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Callable, Iterable, Literal, Protocol, runtime_checkable

import torch

from .types import AlgorithmTraits, LossOutput, PromptBatch, RewardResult, Rollout, Score
from .plans import SamplingPlan

if TYPE_CHECKING:  # the algorithms' shared records live with them; the trainer only calls the member
    from .algorithms._options import KLWeight


@runtime_checkable
class StochasticPolicy(Protocol):
    """A generative model seen as a stochastic policy: it samples and re-scores its own transitions."""

    Config: type
    modalities: frozenset[str]  # what `outputs` holds: {"image"}, {"text"}, {"video"}...
    num_steps: int  # decisions per training rollout (denoising steps, tokens...)
    # scoring method ("log_prob", "likelihood") -> the `Score` fields it fills; a class attribute, so the trainer
    # checks it against the algorithm's `traits.reads` before any model loads. A method not listed is not implemented.
    provides: dict[str, frozenset[str]]
    # the plan families whose plans `sample` reads ("flow", "token", "masked"; its own first, whose deterministic plan
    # evaluation samples with): the trainer refuses an algorithm emitting another family's plans before any model loads
    plan_families: tuple[str, ...]
    # the plan `features()` it implements ("merge", "branch", "unit_selection", "dpm", "likelihood", "elbo",
    # "token_scores", "ground_truth_member"; empty for plain plans only): the trainer refuses a plan asking for more
    plan_features: frozenset[str]
    eval_num_steps: int  # decisions per evaluation sample
    # the optional members it implements beyond this protocol, declared (never probed); empty for none:
    # "input_images": `sample` reads one or more input images per prompt from ``batch.conditions["images"]`` (image
    # editing) and refuses a batch without them (preflight refuses a prompt source with an item without them);
    # "teacher_rollout": ``teacher_rollout(batch, completions) -> Rollout``, the rollout of given completion texts
    # (teacher-forced, one per prompt), which ``mmgrpo sft`` trains on; sft refuses a pipeline without it;
    # "engine_rollout": ``engine_prompts``, ``engine_sampling``, ``engine_rollout``, ``engine_model``,
    # ``engine_weights`` and ``engine_weights_to`` (see `mmgrpo.engines`), with which vLLM / SGLang sample for it;
    # preflight refuses ``rollout.engine`` other than local on a pipeline without it
    # "chunked_rollouts": rollouts of consecutive chunks of a batch join into the batch's (no per-batch padding; see
    # `mmgrpo.overlapped_scoring.cat_rollouts`); preflight refuses ``train.sample_chunks`` > 1 on a pipeline without it
    capabilities: frozenset[str]

    def prepare(self, accelerator) -> list[torch.nn.Module]:
        """Moves the policy to the accelerator's device, wraps its trainable modules with accelerate (DDP, FSDP...)
        and returns the wrapped modules (the trainer uses them for `accelerator.no_sync`)."""

    def sample(self, batch: PromptBatch, plan: SamplingPlan, *, generator: torch.Generator | None = None) -> Rollout:
        """Samples without gradients and records in `Rollout.trajectory` what `log_prob` needs to replay."""

    def log_prob(self, rollout: Rollout, steps: list[int]) -> Score:
        """Replays transitions `steps` of every sample under the current parameters, with gradients.

        Returns a [`Score`] with `log_prob` (`[N, len(steps)]`) and, where they exist, `mean` and `std` of the
        transitions (used for a KL to the reference) and `mask` (`[N, len(steps)]`, bool): the entries that are
        trained transitions of that sample (`rollout.mask`); the others are placeholders losses must ignore.

        Optional member, declared by a ``"likelihood"`` entry in `provides` (the trainer never probes for it):

        - ``likelihood(rollout, steps) -> Score``: for ``scoring = "likelihood"`` algorithms, a sample-only score of the
          final outputs with gradients, `log_prob` `[N, len(steps)]` (minus the flow-matching loss at the plan's noise
          levels for diffusion), plus what the algorithm's loss reads (`velocity`, `group_ids`, the flow-matching
          `target` and noise level `sigma` of each scored point).
        """

    def reference(self) -> AbstractContextManager:
        """A context in which the policy acts as the frozen reference model (e.g. LoRA adapter disabled)."""

    def trainable_parameters(self) -> Iterable[torch.nn.Parameter]: ...

    def trainable_modules(self) -> dict[str, torch.nn.Module]:
        """The modules holding trainable parameters, for `accelerate.prepare` and checkpoints."""

    def save_pretrained(self, path: str) -> None: ...

    def load_trainable(self, path: str) -> None:
        """Loads trainable weights (full or LoRA adapter) written by `save_pretrained`."""

    def export_pretrained(self, path: str, merge_lora: bool = False) -> None:
        """Writes a self-contained model folder that the stock library loads with ``from_pretrained`` alone: the
        whole pipeline or model with its processor, the LoRA merged or in ``lora/`` (``mmgrpo export``)."""


@runtime_checkable
class RewardFn(Protocol):
    """Scores decoded outputs; expensive set-up belongs in ``__init__``.

    Scoring runs in two stages, so that a score may depend on the rest of its group even when a group spans processes:

    1. ``__call__(outputs, batch)``, on each process, scores that process's samples one by one: ``scores`` `[n]`,
       ``components`` (each `[n]`) and, when the group stage needs more than scores, ``features`` `[n, ...]`.
    2. ``group_stage``: `None` when a sample's score depends on that sample only (every reward declares it, most as
       ``group_stage = None``). Otherwise a function ``group_stage(result, group_ids) -> RewardResult`` that the
       trainer calls once per step, and once per evaluation, on the results gathered from every process: ``result``
       holds ``scores`` `[N]`, ``components`` (each `[N]`) and ``features`` `[N, ...]` (or `None`) of the whole batch,
       ``group_ids`` `[N]` are the global groups (`None` when the caller has none: the whole batch is one group). It
       returns the final ``scores`` `[N]` (and the components to log), from which the algorithm's advantages are
       computed. Examples: the per-group normalisation of ``composite``; a set-level diversity reward would put one
       embedding per sample in ``features`` and score each sample against the others of its group here.

    What a reward scores and what it adds for the sample writers are declared by its class for given options, so the
    checks read them before any model loads, and nothing is probed:

    - ``modalities_for(config) -> frozenset[str]`` (a classmethod; `config` an instance of its `Config`): the output
      modalities it scores (``{"text"}``, ``{"image"}``...), which the pipeline must produce. From a ``modality``
      option where it has one (``clip_score``, ``pickscore``, ``aesthetic``...), the configured list (``remote``), the
      union of the components' (``composite``), else fixed.
    - ``artifacts_for(config) -> frozenset[str]`` (a classmethod): the artifact kinds its results carry in
      ``RewardResult.artifacts`` for the sample writers (``sam_mask``: ``{"mask", "seg_prompts"}``, drawn as overlays
      by the text writer; most: none). A reward never writes into the pipeline's `outputs`; the writers draw exactly
      the declared kinds ([`mmgrpo.sample_writers.ARTIFACT_WRITERS`]) and refuse a result that lacks one.

    An instance holds the declarations for its own options as ``modalities`` and ``artifacts``.
    """

    Config: type
    modalities: frozenset[str]  # what this instance scores: its class's modalities_for(its options)
    artifacts: frozenset[str]  # the kinds its results carry in RewardResult.artifacts: artifacts_for(its options)
    group_stage: Callable[[RewardResult, torch.Tensor | None], RewardResult] | None

    @classmethod
    def modalities_for(cls, config) -> frozenset[str]: ...

    @classmethod
    def artifacts_for(cls, config) -> frozenset[str]: ...

    def __call__(self, outputs: dict[str, Any], batch: PromptBatch) -> RewardResult: ...


@runtime_checkable
class Algorithm(Protocol):
    """An advantage estimator and a loss, plus the sampling schedule it asks of a pipeline.

    `scoring` says which policy method scores a unit: ``"trajectory"`` -> ``policy.log_prob`` (replay of the sampled
    transitions), ``"likelihood"`` -> ``policy.likelihood`` (a sample-only surrogate). `traits` (an
    [`~mmgrpo.types.AlgorithmTraits`], built from the options) declares everything else the trainer needs to know,
    with documented defaults: the score fields the loss reads, whether it reads the reference, whether zero advantages
    are inert, and which optional members it has. Every algorithm holds its KL term's weight as `kl` (a
    [`~mmgrpo.algorithms._options.KLWeight`]; weight 0 where it has no KL term): the trainer calls ``kl.step()`` after
    every optimizer update taken and checkpoints ``kl.state_dict()``, so a KL schedule resumes exactly. The trainer
    reads the declaration and never probes for a member:

    - ``after_update(policy)``, when ``traits.after_update``: called after every optimizer update taken.
    - ``after_step()``, when ``traits.after_step``: called once at the end of every training step (one rollout).
    - ``select_samples(advantages, group_ids) -> advantages``, when ``traits.selects_samples``: keeps the samples it
      trains, 0 for the others (DanceGRPO's best-of-N), applied to each batch's advantages.
    - ``state_dict() -> dict`` / ``load_state_dict(state)``, when ``traits.has_state``: saved in and restored from
      checkpoints.
    - ``old_policy(policy) -> ContextManager``, when ``traits.old_source`` is ``"old_model"``: the algorithm keeps its
      own "old" model (DGPO's fast EMA); the trainer scores the unit inside this context, without gradients, and passes
      its `log_prob` as `old_log_prob` (the other sources, the rollout's record and the current score, need nothing).
      With ``traits.old_score`` the loss gets that old [`~mmgrpo.types.Score`] whole instead of its `log_prob` (the
      current score, detached, under ``"current"``): DiffusionNFT's implicit policies mix the old model's velocity in.
    """

    Config: type
    scoring: Literal["trajectory", "likelihood"]
    plan_family: Literal["flow", "token", "masked"]  # the plan type `schedule` returns (FlowPlan, TokenPlan, MaskedPlan)
    traits: AlgorithmTraits
    kl: KLWeight  # the KL term's weight, stepped after every optimizer update taken

    def schedule(self, num_steps: int, generator: torch.Generator | None = None) -> SamplingPlan:
        """The plan of its `plan_family`: which decisions sample and which are trained; `generator` is seeded
        identically on every process."""

    def advantages(self, scores: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
        """`scores` `[N]` and `group_ids` `[N]` gathered from all ranks -> advantages `[N]`."""

    def loss(
        self,
        new: Score,
        old_log_prob: torch.Tensor | Score,
        advantages: torch.Tensor,
        ref: Score | None,
    ) -> LossOutput:
        """Loss of one unit of trained steps for a minibatch: `new` the [`Score`] of the scoring method (`log_prob`
        `[n, k]`, maybe `mask` `[n, k]`...), `old_log_prob` `[n, k]` (the old policy's whole [`Score`] when
        ``traits.old_score``), `advantages` `[n]`, `ref` the reference policy's score (or None)."""


@runtime_checkable
class PromptSource(Protocol):
    """The prompts of a task: training items and held-out (evaluation) items, built from the source's `Config`.

    An item is a dict ``{"prompt": str, "metadata": dict, **conditions}``: `metadata` holds what the reward reads
    (ground-truth answer, boxes, the objects a prompt asks for...), and each other key is a condition the pipeline
    reads (``images``: a list of PIL images per item, ``video``...). The trainer streams `train_items` in a seeded
    order, repeated `group_size` times ([`~mmgrpo.prompt_stream.PromptStream`]), and evaluates on the first
    ``eval.num_prompts`` of each held-out split of `eval_splits` that ``eval.splits`` chooses (default: all); these are
    called while a run is set up, never per step, so they may build every item in memory.
    """

    Config: type
    # True when the source guarantees that no held-out item is also a training item (held-out scores then measure
    # generalisation, and a contract test checks it); False when the split is the user's (prompt files)
    disjoint_splits: bool

    def train_items(self) -> list[dict]:
        """The training items; the trainer refuses an empty list before any model loads."""

    def eval_items(self) -> list[dict]:
        """The held-out items (may be empty when the run does not evaluate)."""

    def eval_splits(self) -> dict[str, list[dict]]:
        """The held-out splits by name: ``"eval"`` first, the in-distribution held-out items (`eval_items`), then any
        split the source generates by a rule no training item satisfies (``"ood"``: more objects than trained, unseen
        combinations, spans at unseen positions...). Evaluation logs ``eval/<metric>`` for ``eval`` and
        ``eval/<split>/<metric>`` for the others. A source with one held-out split returns
        ``{"eval": self.eval_items()}``."""
