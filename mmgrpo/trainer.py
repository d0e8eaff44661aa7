"""The one trainer loop, the same for every pipeline, algorithm and reward.

Per step: next prompt batch repeated `G` times with global group ids -> this process's slice -> ``policy.sample``
(no grad) -> ``reward`` per sample -> scores, components, features and the rollout's group ids gathered from every
process -> the reward's ``group_stage`` on the whole batch, if it has one ([`gather_rewards`]) ->
``algorithm.advantages`` (``[N]``; or ``step_advantages`` ``[N, S]``, per step, where ``traits.step_advantages`` says
so, each unit's loss then getting its columns) -> for each inner epoch and minibatch, each trained unit is scored
(``policy.log_prob`` or ``policy.likelihood``, as ``algorithm.scoring`` says; see [`~mmgrpo.components.score_unit`]),
passed to ``algorithm.loss`` and back-propagated, then clipped and stepped. Distribution: accelerate's DDP, or FSDP2 applied by mmgrpo
(``train.sharding``, see [`mmgrpo.sharding`]). The updates run in [`mmgrpo.updates`]. With ``train.async`` the sampling
and the per-sample reward of each step run ahead of its updates, from weights ``max_staleness`` steps older, in a
worker ([`mmgrpo.async_rollouts`]); the rest of the step is the same.

Skip rules (decided on the batch gathered from every process, so all processes agree):

- A sample whose reward is NaN or infinite is left out of its group's statistics (advantage 0) and is never scored:
  it adds nothing to the loss, KL term included (it keeps its place in the minibatch mean, like a zero-advantage one).
- No sample of the step has a finite reward: no update. Nothing is scored; the weights, the optimizer state, the
  learning-rate schedule and the algorithm's state (e.g. DGPO's old model) stay as they are, KL term or not.
- Every advantage is exactly 0 and the algorithm reads no reference (no KL term): no update, as above (a step would
  only apply weight decay). With a KL term the step is taken: it pulls the policy towards the reference.
- The algorithm declares ``traits.zero_advantage_is_inert``: members of groups whose advantages are all 0 are not scored
  either (the gradient is unchanged); a step with no sample left to score is not taken.
- No process scores a sample of one optimizer update (it holds only samples without reward): that update is not taken.
- The loss or the gradient of an update is NaN or infinite: that update is not taken, its gradient is discarded.

Each update not taken adds 1 to ``train/skipped_updates`` (a step not taken adds every update it would have taken).
The learning-rate schedule and the algorithm's KL weight (its ``kl`` member) count only the updates taken; all are
checkpointed, so resume is exact. ``reward/invalid`` counts the samples without a finite reward and
``train/unscored_share`` is the share of the batch not scored.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from . import checkpoint, sharding, updates, weight_ema
from .advantages import groups_with_signal, reward_advantages
from .async_rollouts import AsyncRollouts, Scored, StepInputs, refuse_stale_schedule, rollout_copy
from .components import build_components
from .config import ExperimentConfig
from .best_checkpoint import BestCheckpoint
from .eval_rewards import held_out_scorer
from .engine_builders import build_engine
from .engines import LocalEngine
from .evaluation import evaluate_splits, finite_mean, gather_rewards, reward_metrics
from .held_out_splits import chosen_splits
from .metrics_log import MetricsLog, read_records
from .optim import build_optimizer
from .overlapped_scoring import ChunkedScoring, PendingScores
from .prompt_stream import PromptStream
from .rollout_correction import correct_rollout
from .plans import SamplingPlan
from .run_loop import make_accelerator, run_steps, timed_step
from .seeding import mix_seed
from .stop_signals import StopSignals
from .tracking import Trackers
from .types import RewardResult, Rollout
from .vas import refresh_weights
from .visualize import plot_reward_curve


@dataclass
class AdvantagedBatch:
    """One step's rollout batch, rewarded and given advantages, before its update ([`Trainer.advantaged`])."""

    inputs: StepInputs
    rollout: Rollout  # this process's samples [n], corrected for the engine's numerics
    corrected: dict[str, float]  # rollout_corr/* metrics
    scores: torch.Tensor  # [N] the whole batch's rewards after the reward's group stage
    components: dict[str, torch.Tensor]  # name -> [N]
    groups: torch.Tensor  # [N] group ids
    advantages: torch.Tensor  # [N] or [N, S]
    with_signal: torch.Tensor  # [N] bool: the sample's group has a non-zero advantage
    rewarded: torch.Tensor  # [N] bool: the reward is finite


class Trainer:
    """Runs an experiment; see the module docstring for the loop."""

    def __init__(self, config: ExperimentConfig, accelerator=None, record_config: bool = True):
        """Builds the run of `config`; `record_config=False` leaves the output folder's ``config.json`` as it is (an
        evaluation of an existing run's checkpoint)."""
        self.config = config
        self.accelerator = accelerator or make_accelerator(config)
        acc = self.accelerator
        self.world, self.rank = acc.num_processes, acc.process_index
        global_n = config.train.prompts_per_step * config.train.group_size
        if global_n % self.world:
            raise ValueError(
                f"prompts_per_step * group_size = {global_n} samples per step does not split over {self.world} "
                "processes: make it a multiple of the number of processes."
            )
        self.local_n = global_n // self.world
        self.scoring = ChunkedScoring(config.train.sample_chunks, config.train.overlap_scoring, self.local_n)
        self.sharding = sharding.check_world(config.train.sharding, self.world)
        self.output_dir = Path(config.output_dir)
        if acc.is_main_process:
            self.output_dir.mkdir(parents=True, exist_ok=True)
        if acc.is_main_process and record_config:
            (self.output_dir / "config.json").write_text(json.dumps(config.to_dict(), indent=2), encoding="utf-8")
        from accelerate.utils import set_seed

        set_seed(config.seed)  # LoRA initialisation and anything else drawn from global RNGs
        self.policy, self.algorithm, self.reward, self.data = build_components(config)
        self.engine = build_engine(config, self.policy)  # what samples the rollouts (rollout.engine)
        # train.async: a rollout copy samples ahead (see mmgrpo.async_rollouts); the local engine samples the copy
        rollout_policy = rollout_copy(self.policy) if config.train.async_ is not None else None
        if rollout_policy is not None:
            refuse_stale_schedule(config.train.async_.max_staleness, config.algorithm.name, self.algorithm.traits)
            if not self.engine.holds_weights:
                self.engine = LocalEngine(rollout_policy)
        self.group_stage = self.reward.group_stage  # the reward's stage after the gather, or None (see RewardFn)
        self.eval_reward = held_out_scorer(self.reward, config.eval)  # with eval.rewards' rewards, if any
        sharding.check_group_placement(config.train, self.world, self.algorithm.traits)
        self.eval_items = chosen_splits(self.data.eval_splits(), config.eval.splits, config.data.name)  # split -> items
        # the whole weights of a checkpoint to resume, on every process, before sharding splits them
        resume = checkpoint.preload(config.checkpoint.resume_from, self.output_dir / "checkpoints", self.policy)
        self.wrapped = sharding.prepare(self.policy, acc, self.sharding, config.train.mixed_precision)
        # after prepare: sharding replaces the parameters by their shards
        self.optimizer, self.lr_scheduler = build_optimizer(self.policy.trainable_parameters(), config.train)
        self.optimizer, self.lr_scheduler = acc.prepare(self.optimizer, self.lr_scheduler)
        # train.ema: the average that evaluations and checkpoints hold
        self.weight_ema = None if config.train.ema is None else weight_ema.WeightEMA(config.train.ema)
        if self.weight_ema is not None:
            self.weight_ema.start(self.policy.trainable_parameters())
        self.stream = PromptStream(self.data.train_items(), seed=config.seed, sampling=config.train.prompt_sampling,
                                   mix=config.train.prompt_sampling_mix, vas=config.train.vas)
        self.log = MetricsLog(self.output_dir, enabled=acc.is_main_process)
        self.rollouts = None if rollout_policy is None else AsyncRollouts(
            config.train.async_.max_staleness, self._sample_and_score, self.policy, rollout_policy, self.engine,
            self.algorithm, acc, config.train.max_steps)
        self.step = 0
        self.skipped_updates = 0
        self.train_seconds = 0.0  # wall-clock time of training steps only (what train.max_seconds limits)
        self.eval_mark = 0.0  # train_seconds at the last evaluation
        if resume:
            self._resume(resume)
        self.best = BestCheckpoint(config.checkpoint.keep_best if record_config else None,
                                   config.checkpoint.keep_best_mode, self.output_dir / "checkpoints", self.step)
        # trackers start once the resumed step is known (TensorBoard then hides what a stopped run wrote after it); an
        # evaluation of an existing run (record_config=False) starts none
        self.log.trackers = Trackers(acc, config, self.step, resume) if record_config and acc.is_main_process else None

    # ------------------------------------------------------------------------------------------------- the loop
    def train(self) -> dict:
        """Runs the remaining steps ([`~mmgrpo.run_loop.run_steps`]), saves, writes the summary and returns it."""
        try:
            stopped_by = run_steps(self, "train", ("reward", "reward/mean"))
        finally:
            if self.rollouts is not None:
                self.rollouts.close()
            self.scoring.close()
        self.save()
        summary = self._finish(stopped_by)  # with a signal, `mmgrpo train` then exits with 128 + its number
        self.log.close()
        return summary

    def timed_train_step(self) -> dict[str, float]:
        """One step with its timing (``time/step_s``, ``time/train_s``), as the loop runs it."""
        return timed_step(self)

    def train_step(self) -> dict[str, float]:
        cfg = self.config
        if self.rollouts is not None:  # train.async: sampled and rewarded ahead, from the weights k steps older
            inputs, rollout, scores = self.rollouts.take(self.step, self._step_inputs, self.stream)
            refreshed = {}
        else:
            refreshed = refresh_weights(self.stream, self.policy, self.algorithm, self.reward, self.accelerator,
                                        cfg.seed, self.step) if self.stream.refresh_due(self.step - 1) else {}  # VAS
            inputs = self._step_inputs(self.step)
            rollout, scores = self._sample_and_score(inputs)
        scored = self.advantaged(inputs, rollout, scores)
        batch, all_scores, all_groups = inputs.batch, scored.scores, scored.groups
        if self.stream.adaptive:  # group_variance sampling reads back each prompt's group rewards (batch order)
            self.stream.observe(all_scores, batch.group_ids - (self.step - 1) * cfg.train.prompts_per_step)
        local_adv = self._this_process(scored.advantages, len(inputs.local))
        metrics = reward_metrics(all_scores, all_groups, scored.components)
        if self.algorithm.traits.ground_truth_member:  # TempSamp: the reward of the policy's own answers alone
            metrics["reward/sampled_mean"] = finite_mean(all_scores[batch.member_ids != 0])
        rollout, with_signal, rewarded = scored.rollout, scored.with_signal, scored.rewarded
        metrics.update(self.update(rollout, inputs.plan, local_adv, with_signal, inputs.generator, rewarded))
        if self.engine.holds_weights and self.rollouts is None:  # vLLM / SGLang: their own copy takes this step's
            # weights (train.async: each production syncs the engine to its own version instead)
            self.engine.sync_weights(self.policy)
        metrics["lr"] = self.lr_scheduler.get_last_lr()[0]
        metrics["samples_seen"] = self.step * len(all_scores)
        metrics["time/reward_wait_s"] = scores.exposed_s  # reward time not overlapped with sampling (sample_chunks)
        metrics.update({**refreshed, **scored.corrected})  # the VAS refresh before this batch (vas/*), rollout_corr/*
        if self.algorithm.traits.after_step:
            self.algorithm.after_step()  # one rollout iteration done (MixGRPO's window), updates taken or not
        if self.rollouts is not None:
            self.rollouts.settle()  # the step ends when the production queued during it is done
        return metrics

    def _step_inputs(self, step: int) -> StepInputs:
        """Step `step`'s prompts (the stream's next batch, repeated `G` times with global group ids; this process's
        slice), its plan and its generator (per-step seeds)."""
        cfg = self.config
        batch = self.stream.next_batch(cfg.train.prompts_per_step).repeat(
            cfg.train.group_size, first_group_id=(step - 1) * cfg.train.prompts_per_step
        )
        local = batch.select(range(self.rank * self.local_n, (self.rank + 1) * self.local_n))
        plan = self.algorithm.schedule(self.policy.num_steps, torch.Generator().manual_seed(mix_seed(cfg.seed, step)))
        generator = torch.Generator().manual_seed(mix_seed(cfg.seed, step, self.rank, 1))
        return StepInputs(step, batch, local, plan, generator)

    def _sample_and_score(self, inputs: StepInputs):
        """The step's rollout, sampled through ``self.engine``, and its pending reward result (``train.sample_chunks``
        chunks, see [`~mmgrpo.overlapped_scoring.ChunkedScoring`])."""
        return self.scoring.sample(self.engine, self.reward, inputs.local, inputs.plan, inputs.generator)

    def gather_rewards(self, result: RewardResult, group_ids: torch.Tensor) -> tuple[RewardResult, torch.Tensor]:
        """[`~mmgrpo.evaluation.gather_rewards`] over this run's processes with the reward's group stage: returns
        ``(result [N], groups [N])``."""
        return gather_rewards(self.accelerator, result, group_ids, self.group_stage)

    def rollout_batch(self, step: int) -> AdvantagedBatch:
        """Training step `step`'s batch as [`train_step`] draws it (its prompts, plan and generator), sampled at the
        current weights, rewarded and given advantages; no update is taken and nothing else changes but the prompt
        stream's position. For measurements on rollout batches (``bench/gradient_snr.py``)."""
        inputs = self._step_inputs(step)
        rollout, scores = self._sample_and_score(inputs)
        return self.advantaged(inputs, rollout, scores)

    def advantaged(self, inputs: StepInputs, rollout: Rollout, scores: PendingScores | Scored) -> AdvantagedBatch:
        """This process's `rollout` of `inputs` with its pending reward `scores`: the rollout corrected for the
        engine's numerics ([`~mmgrpo.rollout_correction.correct_rollout`], while the reward may still be scoring),
        then the whole batch's rewards and advantages, as ``train.group_placement`` places them."""
        cfg = self.config
        rollout, corrected = correct_rollout(rollout, self.policy, self.algorithm, inputs.plan.train_units,
                                             cfg.train.minibatch_size)
        contiguous = cfg.train.group_placement == "contiguous"
        placed = self.local_advantages if contiguous else self.global_advantages
        members = inputs.local.member_ids if contiguous else inputs.batch.member_ids  # the advantages' samples
        whole, groups, advantages = placed(scores.result(), rollout.group_ids, members, inputs.plan,
                                           rollout.old_log_probs)
        final = whole.scores.float()  # [N] after the reward's group stage
        return AdvantagedBatch(inputs, rollout, corrected, final, whole.components, groups, advantages,
                               groups_with_signal(advantages, groups), torch.isfinite(final))

    def global_advantages(self, result: RewardResult, group_ids: torch.Tensor, member_ids: torch.Tensor | None = None,
                          plan: SamplingPlan | None = None, log_probs: torch.Tensor | None = None):
        """[`gather_rewards`] of this process's reward `result` and `group_ids` `[n]`, then ``algorithm.advantages``
        on the whole batch (``step_advantages`` with the whole batch's `member_ids` `[N]`, the `plan` and the gathered
        `log_probs` `[N, S]` (this process's rollout's `[n, S]`), where the algorithm declares them). Returns
        ``(result [N] after the group stage, groups [N], advantages [N] or [N, S])``."""
        whole, all_groups = self.gather_rewards(result, group_ids)
        if self.algorithm.traits.step_advantages and log_probs is not None:
            log_probs = self.accelerator.gather(log_probs.to(self.accelerator.device)).cpu()  # [N, S], rank order
        return whole, all_groups, reward_advantages(self.algorithm, whole, all_groups, member_ids, plan, log_probs)

    def local_advantages(self, result: RewardResult, group_ids: torch.Tensor, member_ids: torch.Tensor | None = None,
                         plan: SamplingPlan | None = None, log_probs: torch.Tensor | None = None):
        """``train.group_placement: contiguous``: this process holds whole groups, so the reward's group stage and
        ``algorithm.advantages`` run on its own samples (`member_ids` `[n]` are theirs); then the final scores,
        components, groups and advantages are gathered. Returns what [`global_advantages`] returns."""
        if self.group_stage is not None:
            result = self.group_stage(result, group_ids)
        if result.scores_are_advantages and self.world > 1:  # preflight refuses it: a batch statistic, per process
            raise ValueError("train.group_placement: contiguous cannot run a reward whose scores are the batch's "
                             "advantages (composite normalize_then_sum): use spread.")
        advantages = reward_advantages(self.algorithm, result, group_ids, member_ids, plan, log_probs)  # [n] or [n, S]

        def gather(values: torch.Tensor) -> torch.Tensor:  # [n, ...] on every process -> [N, ...], rank order
            return self.accelerator.gather(values.to(self.accelerator.device)).cpu()

        whole = RewardResult(scores=gather(result.scores),
                             components={name: gather(values) for name, values in result.components.items()})
        return whole, gather(group_ids), gather(advantages)

    def _this_process(self, values: torch.Tensor, n: int) -> torch.Tensor:
        """This process's slice `[n, ...]` of a batch gathered from every process `[N, ...]`."""
        return values[self.rank * n : (self.rank + 1) * n]

    def update(self, rollout: Rollout, plan: SamplingPlan, advantages: torch.Tensor, with_signal: torch.Tensor,
               generator: torch.Generator, rewarded: torch.Tensor | None = None) -> dict:
        """The step's optimizer updates on this process's `rollout` `[n]` with its `advantages` (`[n]` or `[n, S]`),
        under the skip rules decided on the whole batch (`with_signal`, `rewarded`: `[N]` bool); see
        [`~mmgrpo.updates.update`]. [`train_step`] calls it with an [`AdvantagedBatch`]'s fields; benches and tests
        call it to update on a batch of their own."""
        return updates.update(self, rollout, plan, advantages, with_signal, generator, rewarded)

    # --------------------------------------------------------------------------------------------- evaluation
    def evaluate(self, step: int, batch_size: int = 64) -> dict[str, float]:
        """Deterministic samples of the held-out prompts (same noise every time), each its own group: the reward
        means (after the reward's group stage, on every process's items), the scores per prompt (``eval/step_*.json``)
        and the samples, written by the writers of the pipeline's output modalities ([`mmgrpo.sample_writers`]); see
        [`~mmgrpo.evaluation.evaluate_splits`]: each held-out split ``eval.splits`` chooses."""
        with weight_ema.applied_or_not(self.weight_ema, self.policy.trainable_parameters()):  # train.ema's average
            metrics = evaluate_splits(self.policy, self.eval_reward, self.eval_items, self.config.eval,
                                      self.accelerator, self.output_dir, step, self.log.trackers, batch_size)
        self.best.observe(metrics, step, self.save)  # checkpoint.keep_best: a better evaluation saves a checkpoint
        return metrics

    # ------------------------------------------------------------------------------------------- checkpoints
    def save(self, root: Path | None = None, extra: dict | None = None) -> Path:
        """Saves a checkpoint of this step under ``checkpoints/`` (or as the only one in `root`, with `extra` in its
        ``trainer_state.json``: the best checkpoint)."""
        # train.async: the stream before the first batch not trained on, and the weights its rollouts sample from
        stream = self.stream.state_dict() if self.rollouts is None else self.rollouts.stream_state(self.stream)
        state = {"data_position": stream["position"], "skipped_updates": self.skipped_updates,
                 "train_seconds": self.train_seconds, "prompt_stream": stream, **(extra or {}),
                 **self.log.tracker_state()}  # the trackers' run ids, continued on resume
        files = {} if self.rollouts is None else self.rollouts.checkpoint_files()
        with weight_ema.applied_or_not(self.weight_ema, self.policy.trainable_parameters()) as trained:
            if self.weight_ema is not None:  # train.ema: weights/ hold the average, the trained weights a file
                files.update(self.weight_ema.checkpoint_files(trained))
            return checkpoint.save(
                self.accelerator, root or self.output_dir / "checkpoints", self.step, self.policy, self.optimizer,
                self.lr_scheduler, state, 1 if root else self.config.checkpoint.keep_last, algorithm=self.algorithm,
                modules=self.wrapped, files=files,
            )

    def _resume(self, path: Path) -> None:
        """Restores the training state of checkpoint `path` (its weights were loaded before ``prepare``)."""
        if self.weight_ema is None:
            weight_ema.refuse_averaged_checkpoint(path)
        state = checkpoint.load(self.accelerator, path, self.policy, self.optimizer, self.lr_scheduler, self.algorithm,
                                weights=False)
        self.step = state["step"]
        self.stream.load_state_dict(state.get("prompt_stream", {"position": state["data_position"]}))
        self.skipped_updates = state["skipped_updates"]
        self.train_seconds = self.eval_mark = state.get("train_seconds", 0.0)  # absent in older checkpoints
        self.log.truncate_after(self.step)
        if self.rollouts is not None:
            self.rollouts.load(path)  # the weight versions of the rollouts that were in flight
        if self.weight_ema is not None:  # weights/ held the average: it becomes the average again, the trained
            self.weight_ema.resume(path, self.policy.trainable_parameters())  # weights come from their own file

    def load_weights(self, checkpoint_dir: str) -> None:
        """Loads only the trainable weights of a checkpoint (a folder, or ``"latest"`` under this run's output_dir)
        and takes its step: what [`evaluate`] needs. Optimizer, schedule, RNG and algorithm states are not read."""
        path = checkpoint.resolve(checkpoint_dir, self.output_dir / "checkpoints")
        self.step = checkpoint.load_weights(path, self.policy, modules=self.wrapped)["step"]
        if self.weight_ema is not None:  # train.ema: the checkpoint's weights are the average it evaluated
            self.weight_ema.start(self.policy.trainable_parameters())

    def _finish(self, stopped_by: str | None = None) -> dict:
        summary = {"steps": self.step, "skipped_updates": self.skipped_updates, "train_seconds": round(self.train_seconds, 3)}
        if stopped_by:
            summary["stopped_by"] = stopped_by
        summary.update(self.best.summary())  # checkpoint.keep_best's checkpoint, if any
        metrics_file = self.output_dir / "metrics.jsonl"
        if self.accelerator.is_main_process and metrics_file.is_file():
            metric = self.config.eval.metric
            evals = [r for r in read_records(metrics_file) if f"eval/{metric}" in r]  # a torn last line is skipped
            if evals:
                summary.update({f"eval_{metric}_first": evals[0][f"eval/{metric}"], f"eval_{metric}_last": evals[-1][f"eval/{metric}"]})
            plot_reward_curve(metrics_file, self.output_dir / "reward_curve.png", metric)
            (self.output_dir / "summary.json").write_text(json.dumps(summary, indent=2), encoding="utf-8")
        return summary


def train(config: ExperimentConfig) -> dict:
    """Builds a [`Trainer`] for `config` and runs it; returns the summary (first/last eval metric...). A SIGINT /
    SIGTERM while the trainer is built stops at once (see [`~mmgrpo.stop_signals.StopSignals`])."""
    with StopSignals(announce=os.environ.get("RANK", "0") == "0", at_once=True):
        trainer = Trainer(config)
    return trainer.train()
