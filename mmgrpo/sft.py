"""Supervised fine-tuning, the cold start before RL: ``mmgrpo sft CONFIG [key=value ...]``.

The config is an ordinary experiment config (see [`mmgrpo.config`]) read with its ``sft`` section
([`~mmgrpo.config.SFTConfig`]): ``pipeline``, ``data``, ``train`` (sizes and optimizer), ``checkpoint``, ``tracking``;
the algorithm and reward sections are what a following ``mmgrpo train`` uses. Each training item's metadata holds its
target completion under ``sft.target_key`` (a JSONL row's ``"completion"``, or ``vlm_shapes`` with ``with_targets``).

**Loss** (completion-only): for a batch of prompts ``x_i`` and targets ``y_i`` (followed by the end-of-turn token),

    L = - sum_i sum_t log pi(y_i,t | x_i, y_i,<t) / sum_i |y_i|,

the mean negative log-likelihood of the target tokens under the policy (``pi = softmax(logits / temperature)``, the
pipeline's temperature: keep it 1.0 for plain SFT). The prompt's tokens are never in the loss. The targets are scored
by the policy's own replay path: ``policy.teacher_rollout(batch, targets)`` builds a rollout of the targets and
``policy.log_prob`` scores it, so SFT and RL share one forward.

**Thought dropout** (TON, "Think or Not? Selective Reasoning via Reinforcement Learning for Vision-Language Models",
https://arxiv.org/abs/2505.16854): with probability ``sft.thought_dropout`` the content of a target's
``<think>...</think>`` is replaced by an empty thought ``<think>\\n\\n</think>``, teaching a "skip thinking" mode that
GRPO can then select. The draw is fixed per item: ``u = Random(mix_seed(seed, item index)).random() < p``.

**Held-out loss**: with ``eval.every`` (or ``eval.every_seconds``), the same mean NLL on the targets of the first
``eval.num_prompts`` held-out items, as they are (no thought dropout), at step 0, every ``eval.every`` steps and at the
last step (``eval/loss``, ``eval/tokens``). Held-out items without a target are refused before any model loads. With
``sft.eval_reward`` the same evaluations also sample the held-out prompts greedily and score them with the config's
reward, exactly as ``mmgrpo train`` evaluates (``eval/score``, ``eval/<component>``, ``eval/step_*.json``, samples).

**Output**: ``metrics.jsonl`` (``train/loss``, ``train/tokens``, ``train/thought_dropped``, ``train/grad_norm``,
``lr``, ``eval/loss``...) and trackers, atomic pickle-free checkpoints (``checkpoints/step_*``, resumable with
``checkpoint.resume_from``), and at the end ``<output_dir>/model``: the whole model with any LoRA merged
(``export_pretrained(..., merge_lora=True)``), which ``pipeline.pretrained: <output_dir>/model`` trains with RL.
Pipelines: those with a ``teacher_rollout`` (``qwen_vl``); others are refused before any model loads.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import re
from pathlib import Path

import torch

from . import checkpoint, registry, sharding
from .config import ExperimentConfig
from .evaluation import evaluate_splits, process_share
from .held_out_splits import DEFAULT_SPLIT, chosen_splits
from .metrics_log import MetricsLog, read_records
from .optim import build_optimizer
from .prompt_stream import PromptStream, items_to_batch
from .run_loop import make_accelerator, run_steps, sum_over_processes
from .seeding import mix_seed
from .stop_signals import StopSignals
from .tracking import Trackers
from .validation import ConfigError

THOUGHT = re.compile(r"<think>.*?</think>", re.DOTALL)
EMPTY_THOUGHT = "<think>\n\n</think>"
MODEL_FOLDER = "model"


def thought_dropped(p: float, seed: int, index: int) -> bool:
    """Whether item `index` of a run seeded `seed` has its thought dropped, with probability `p` (fixed per item)."""
    return random.Random(mix_seed(seed, index)).random() < p


def drop_thought(text: str) -> str:
    """`text` with the content of every ``<think>...</think>`` emptied (``<think>\\n\\n</think>``)."""
    return THOUGHT.sub(EMPTY_THOUGHT, text)


def sft_pipelines() -> list[str]:
    """The registered pipelines that can be fine-tuned with ``mmgrpo sft``: those declaring the ``teacher_rollout``
    capability (a teacher-forced rollout of given answers; see [`mmgrpo.protocols.StochasticPolicy`])."""
    names = registry.available("pipeline")
    return [name for name in names if "teacher_rollout" in registry.get("pipeline", name).capabilities]


def check(config: ExperimentConfig) -> list[dict]:
    """What ``mmgrpo sft`` checks before any model loads: the pipeline can build teacher-forced rollouts and every
    training item holds a text target under ``sft.target_key``. Returns the training items."""
    from .preflight import check_checkpoint, check_output_dir

    check_output_dir(config)
    check_checkpoint(config, resuming=True)
    unused = [key for key, set_ in (("train.ema", config.train.ema is not None),
                                    ("train.async", config.train.async_ is not None),
                                    ("train.sample_chunks", config.train.sample_chunks != 1)) if set_]
    if unused:
        raise ConfigError(f"{', '.join(unused)}: mmgrpo sft does not use these options of RL rollouts and evaluation "
                          f"(mmgrpo train); remove them from the SFT config.")
    name = config.pipeline.name
    if "teacher_rollout" not in registry.get("pipeline", name).capabilities:
        raise ConfigError(
            f"pipeline.name: mmgrpo sft does not support pipeline {name!r}: it declares no teacher_rollout capability "
            f"(supervised fine-tuning of masked-diffusion LMs and of image / video generators is not implemented); "
            f"supported: {sft_pipelines()}."
        )
    try:
        data = registry.get("data", config.data.name)(config.data.options)
        items = data.train_items()
    except ValueError as err:
        raise ConfigError(f"data: {' '.join(str(err).split())}") from None
    if not items:
        raise ConfigError(f"data: prompt source {config.data.name!r} has no training items.")
    key = config.sft.target_key
    missing = first_without_target(items, key)
    if missing:
        raise ConfigError(
            f"sft.target_key: training item {missing[0]} has no text target under metadata[{key!r}] (got "
            f"{missing[1]!r}): give each row a {key!r} field, set sft.target_key to the field that holds the target, "
            "or use a prompt source option that writes targets (vlm_shapes: with_targets: true)."
        )
    if config.eval.every or config.eval.every_seconds:
        held_out_targets(config, data)
        if config.sft.eval_reward:
            from .preflight import check_modalities

            check_modalities(config)  # the reward scores what the pipeline writes
            reward_splits(config, [], data)  # eval.splits names splits the source declares
    return items


def reward_splits(config: ExperimentConfig, held_out: list[dict], data=None) -> dict[str, list[dict]]:
    """The held-out splits ``sft.eval_reward`` samples and scores: those ``eval.splits`` chooses among the prompt
    source's (`data`, built from the config when not given), the ``eval`` split being `held_out` (its first
    ``eval.num_prompts`` items, those of the held-out loss)."""
    if data is None:
        data = registry.get("data", config.data.name)(config.data.options)
    chosen = chosen_splits(data.eval_splits(), config.eval.splits, config.data.name)
    return {name: held_out if name == DEFAULT_SPLIT else items for name, items in chosen.items()}


def first_without_target(items: list[dict], key: str) -> tuple[int, object] | None:
    """``(index, value)`` of the first of `items` whose ``metadata[key]`` is not a non-empty text, or None."""
    for index, item in enumerate(items):
        target = item.get("metadata", {}).get(key)
        if not isinstance(target, str) or not target:
            return index, target
    return None


def held_out_targets(config: ExperimentConfig, data=None) -> list[dict]:
    """The first ``eval.num_prompts`` held-out items of the prompt source (`data`, built from the config when not
    given), each checked to hold a text target under ``sft.target_key``: what the held-out loss of ``mmgrpo sft``
    scores every ``eval.every`` steps."""
    from .preflight import held_out_options

    if data is None:
        data = registry.get("data", config.data.name)(config.data.options)
    items, key = data.eval_items()[: config.eval.num_prompts], config.sft.target_key
    if not items:
        raise ConfigError(
            f"eval.every: mmgrpo sft scores the target loss of held-out items, and prompt source {config.data.name!r} "
            f"has none: give it some ({held_out_options(config.data.options)}) or set eval.every=0 and "
            "eval.every_seconds=0."
        )
    missing = first_without_target(items, key)
    if missing:
        raise ConfigError(
            f"eval.every: mmgrpo sft scores the target loss of held-out items, and held-out item {missing[0]} has no "
            f"text target under metadata[{key!r}] (got {missing[1]!r}): give the held-out rows a {key!r} field too, "
            "or set eval.every=0 and eval.every_seconds=0."
        )
    return items


class SFTTrainer:
    """Supervised fine-tuning of a policy on its prompt source's targets (see the module docstring).

    Args:
        config ([`~mmgrpo.config.ExperimentConfig`]): the experiment; ``train``, ``sft``, ``checkpoint`` and
            ``tracking`` drive the run.
        accelerator (*optional*): an `Accelerator` (default: one built like the RL trainer's).
        items (`list[dict]`, *optional*): the training items when already checked by [`check`].
    """

    def __init__(self, config: ExperimentConfig, accelerator=None, items: list[dict] | None = None):
        from accelerate.utils import set_seed

        self.config = config
        items = check(config) if items is None else items  # before any model loads
        self.output_dir = Path(config.output_dir)
        # one optimizer update per step: the schedule counts max_steps updates
        self.train_config = dataclasses.replace(config.train, updates_per_step=1, inner_epochs=1)
        self.accelerator = acc = accelerator or make_accelerator(config)
        self.world, self.rank = acc.num_processes, acc.process_index
        if config.train.prompts_per_step % self.world:
            raise ValueError(f"train.prompts_per_step = {config.train.prompts_per_step} items per SFT step does not "
                             f"split over {self.world} processes: make it a multiple of the number of processes.")
        self.local_n = config.train.prompts_per_step // self.world
        self.sharding = sharding.check_world(config.train.sharding, self.world)
        if acc.is_main_process:
            self.output_dir.mkdir(parents=True, exist_ok=True)
            (self.output_dir / "config.json").write_text(json.dumps(config.to_dict(), indent=2), encoding="utf-8")
        set_seed(config.seed)  # LoRA initialisation
        self.policy = registry.get("pipeline", config.pipeline.name)(config.pipeline.options)
        resume = checkpoint.preload(config.checkpoint.resume_from, self.output_dir / "checkpoints", self.policy)
        self.wrapped = sharding.prepare(self.policy, acc, self.sharding, config.train.mixed_precision)
        self.optimizer, self.lr_scheduler = build_optimizer(self.policy.trainable_parameters(), self.train_config)
        self.optimizer, self.lr_scheduler = acc.prepare(self.optimizer, self.lr_scheduler)
        self.stream = PromptStream(items, seed=config.seed)
        self.evaluating = bool(config.eval.every or config.eval.every_seconds)
        self.eval_items = held_out_targets(config) if self.evaluating else []
        reward_cls = registry.get("reward", config.reward.name) if self.evaluating and config.sft.eval_reward else None
        self.reward = reward_cls(config.reward.options) if reward_cls else None
        self.reward_splits = reward_splits(config, self.eval_items) if self.reward is not None else {}
        self.log = MetricsLog(self.output_dir, enabled=acc.is_main_process)
        self.step, self.skipped_updates, self.train_seconds = 0, 0, 0.0
        self.eval_mark = 0.0  # train_seconds at the last held-out evaluation
        if resume:
            state = checkpoint.load(acc, resume, self.policy, self.optimizer, self.lr_scheduler, weights=False)
            self.step, self.skipped_updates = state["step"], state["skipped_updates"]
            self.train_seconds = self.eval_mark = state["train_seconds"]
            self.stream.load_state_dict(state["prompt_stream"])
            self.log.truncate_after(self.step)
        self.log.trackers = Trackers(acc, config, self.step) if acc.is_main_process else None

    # ------------------------------------------------------------------------------------------------- targets
    def targets(self, metadata: list[dict], indices: list[int]) -> tuple[list[str], list[bool]]:
        """The target completions of the training items at `indices` (their `metadata`) after thought dropout, and
        which were dropped."""
        p, seed = self.config.sft.thought_dropout, self.config.seed
        dropped = [thought_dropped(p, seed, index) for index in indices]
        texts = [m[self.config.sft.target_key] for m in metadata]
        return [drop_thought(t) if d else t for t, d in zip(texts, dropped)], dropped

    def backward(self, rollout, scale: float) -> float:
        """Back-propagates the summed target-token NLL of a teacher-forced `rollout` times `scale`, minibatch by
        minibatch (``train.minibatch_size`` items); returns the summed NLL."""
        total, steps = 0.0, list(range(rollout.mask.shape[1]))
        chunks = torch.arange(len(rollout)).split(self.config.train.minibatch_size)
        for j, index in enumerate(chunks):
            score = self.policy.log_prob(rollout.select(index), steps)  # log_prob [m, T], 0 off the target tokens
            nll = -score.log_prob.sum()
            with self._no_sync(last=j == len(chunks) - 1):
                self.accelerator.backward(nll * scale)
            total += float(nll.detach())
        return total

    def _no_sync(self, last: bool):
        """No gradient all-reduce for every minibatch but the last of a step."""
        import contextlib

        stack = contextlib.ExitStack()
        if not last:
            for module in self.wrapped:
                stack.enter_context(self.accelerator.no_sync(module))
        return stack

    # ---------------------------------------------------------------------------------------------------- loop
    def train_step(self) -> dict[str, float]:
        """One optimizer update on the next `train.prompts_per_step` items (this process's share)."""
        batch = self.stream.next_batch(self.config.train.prompts_per_step)
        indices = list(self.stream.last)
        mine = range(self.rank * self.local_n, (self.rank + 1) * self.local_n)
        local = batch.select(mine)
        targets, dropped = self.targets(local.metadata, [indices[i] for i in mine])
        rollout = self.policy.teacher_rollout(local, targets)  # mask [n, T]: the target tokens
        global_tokens = self._sum(float(rollout.mask.sum()))
        # DDP averages gradients over processes: scaling by world / tokens gives the mean over every target token
        nll = self.backward(rollout, scale=self.world / global_tokens)
        parameters = self.policy.trainable_parameters()
        grad_norm = sharding.clip(self.accelerator, self.sharding, parameters, self.train_config)
        if torch.isfinite(torch.as_tensor(grad_norm)):
            self.optimizer.step()
            self.lr_scheduler.step()
        else:
            self.skipped_updates += 1  # a NaN / inf gradient never reaches the weights
        self.optimizer.zero_grad(set_to_none=True)
        return {
            "train/loss": self._sum(nll) / global_tokens,
            "train/tokens": global_tokens,
            "train/thought_dropped": self._sum(float(sum(dropped))) / self.config.train.prompts_per_step,
            "train/grad_norm": float(grad_norm),
            "train/skipped_updates": self.skipped_updates,
            "lr": self.lr_scheduler.get_last_lr()[0],
            "samples_seen": self.step * self.config.train.prompts_per_step,
        }

    def evaluate(self, step: int) -> dict[str, float]:
        """The held-out loss ([`held_out_loss`]) and, with ``sft.eval_reward``, the held-out reward of greedy samples
        on each split of ``eval.splits`` as ``mmgrpo train`` evaluates them ([`~mmgrpo.evaluation.evaluate_splits`],
        files named after `step`)."""
        metrics = self.held_out_loss()
        if self.reward is not None:
            metrics.update(evaluate_splits(self.policy, self.reward, self.reward_splits, self.config.eval,
                                           self.accelerator, self.output_dir, step, self.log.trackers))
        return metrics

    @torch.no_grad()
    def held_out_loss(self) -> dict[str, float]:
        """The held-out loss: the mean NLL per target token of the first ``eval.num_prompts`` held-out items' targets
        (as they are: no thought dropout), over every process's equal share (``eval/loss``, ``eval/tokens``)."""
        mine, _ = process_share(self.eval_items, self.world, self.rank)
        key, size = self.config.sft.target_key, self.config.train.minibatch_size
        nll, tokens = 0.0, 0.0
        for start in range(0, len(mine), size):
            chunk = mine[start : start + size]
            batch = items_to_batch(chunk)
            batch.group_ids = torch.arange(len(batch))
            rollout = self.policy.teacher_rollout(batch, [item["metadata"][key] for item in chunk])  # mask [m, T]
            score = self.policy.log_prob(rollout, list(range(rollout.mask.shape[1])))  # log_prob [m, T]
            nll -= float(score.log_prob.sum())
            tokens += float(rollout.mask.sum())
        nll, tokens = self._sum(nll), self._sum(tokens)
        return {"eval/loss": nll / tokens, "eval/tokens": tokens}

    def _sum(self, value: float) -> float:
        """The sum of `value` over every process."""
        return sum_over_processes(self.accelerator, value)

    def train(self) -> dict:
        """Runs the remaining steps ([`~mmgrpo.run_loop.run_steps`]), saves a checkpoint, writes ``model/`` and
        ``summary.json``; returns the summary. A SIGINT / SIGTERM finishes the step and saves (no ``model/``: resume
        to finish)."""
        stopped_by = run_steps(self, "sft", ("loss", "train/loss"))
        self.save()
        if stopped_by is None:
            self.export(self.output_dir / MODEL_FOLDER)
        summary = self._finish(stopped_by)
        self.log.close()
        return summary

    def save(self) -> Path:
        state = {"data_position": self.stream.position, "prompt_stream": self.stream.state_dict(),
                 "skipped_updates": self.skipped_updates, "train_seconds": self.train_seconds}
        return checkpoint.save(self.accelerator, self.output_dir / "checkpoints", self.step, self.policy,
                               self.optimizer, self.lr_scheduler, state, self.config.checkpoint.keep_last,
                               modules=self.wrapped)

    def export(self, folder: Path) -> None:
        """Writes the fine-tuned model, any LoRA merged, to `folder` (under a temporary name, then renamed)."""
        with sharding.full_parameters(self.wrapped, here=self.accelerator.is_main_process):
            if self.accelerator.is_main_process:
                with checkpoint.atomic_folder(folder, "the fine-tuned model") as tmp:
                    self.policy.export_pretrained(str(tmp), merge_lora=True)
        self.accelerator.wait_for_everyone()

    def _finish(self, stopped_by: str | None) -> dict:
        summary = {"steps": self.step, "skipped_updates": self.skipped_updates,
                   "train_seconds": round(self.train_seconds, 3), "processes": self.world}
        metrics_file = self.output_dir / "metrics.jsonl"
        if self.accelerator.is_main_process and metrics_file.is_file():
            records = read_records(metrics_file)
            metric = self.config.eval.metric
            for name, key in (("loss", "train/loss"), ("eval_loss", "eval/loss"), (f"eval_{metric}", f"eval/{metric}")):
                values = [r[key] for r in records if r.get(key) is not None]
                if values:
                    summary.update({f"{name}_first": values[0], f"{name}_last": values[-1]})
        if stopped_by:
            summary["stopped_by"] = stopped_by
        else:
            summary["model"] = MODEL_FOLDER  # relative to output_dir
        if self.accelerator.is_main_process:
            (self.output_dir / "summary.json").write_text(json.dumps(summary, indent=2), encoding="utf-8")
        return summary


def sft(config: ExperimentConfig, items: list[dict] | None = None) -> dict:
    """Builds an [`SFTTrainer`] for `config` and runs it; returns the summary. A SIGINT / SIGTERM while it is built
    stops at once (see [`~mmgrpo.stop_signals.StopSignals`])."""
    with StopSignals(announce=os.environ.get("RANK", "0") == "0", at_once=True):
        trainer = SFTTrainer(config, items=items)
    return trainer.train()
