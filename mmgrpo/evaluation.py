"""The work of an evaluation, outside the trainer: which held-out splits are evaluated, which items a process takes,
sampling and scoring them batch by batch while the sample writers keep the first ones, gathering the results, the
reward's group stage, and writing the scores and samples of each split.

A prompt source declares its held-out splits (``eval_splits()``, see [`mmgrpo.protocols.PromptSource`]): ``eval``, the
in-distribution one, and any split it generates by a rule no training item satisfies (``ood``). ``eval.splits``
chooses among them (default: all). The ``eval`` split is logged as ``eval/score`` and ``eval/<component>``, per prompt
in ``eval/step_*.json`` and with samples in ``samples/``; another split ``S`` as ``eval/S/score`` and
``eval/S/<component>``, in ``eval/S/step_*.json`` and ``samples/S/`` (its samples are not sent to the trackers, whose
sample tags leave folders out). Items whose metadata name a ``kind`` (the shapes tasks': ``single`` / ``counting`` /
..., ``recolor`` / ``remove`` / ``move``) add the headline metric's mean per kind, ``eval/kind/<kind>/<metric>`` (or
``eval/S/kind/...``), when the split holds 2 to `KIND_LIMIT` kinds: which kinds RL improves, and which it does not."""

from __future__ import annotations

from pathlib import Path

import torch

from .prompt_stream import items_to_batch
from .seeding import mix_seed
from .types import RewardResult
from .plans import SamplingPlan, deterministic_plan
from .held_out_splits import DEFAULT_SPLIT, split_path

KIND_LIMIT = 16  # at most this many kinds get their own metric (a free-form metadata field could name thousands)


def evaluation_due(every: int, every_seconds: float, step: int, train_seconds: float, last_mark: float) -> bool:
    """Whether `every` (``eval.every``) divides `step`, or the training time passed a multiple of `every_seconds`
    (``eval.every_seconds``) since `last_mark`, the training time of the last evaluation (0 disables either)."""
    if every and step % every == 0:
        return True
    return bool(every_seconds) and train_seconds // every_seconds > last_mark // every_seconds


def process_share(items: list, world: int, rank: int) -> tuple[list, int]:
    """This process's equal share of `items` (the remainder that does not split over `world` processes is left out;
    one item at least is evaluated) and the index of its first item among all processes' shares."""
    items = items[: len(items) - len(items) % world] or items[:1]
    per_rank = max(1, len(items) // world)
    return items[rank * per_rank : (rank + 1) * per_rank], rank * per_rank


def evaluation_plan(policy) -> SamplingPlan:
    """The plan every evaluation samples with: the pipeline's own deterministic sampler (its first plan family) over
    its evaluation steps."""
    return deterministic_plan(policy.plan_families[0], policy.eval_num_steps)


@torch.no_grad()
def sample_and_score(policy, reward, items: list, plan: SamplingPlan, generator: torch.Generator, writers: list,
                     first_group: int = 0, batch_size: int = 64, progress: bool = False) -> tuple[RewardResult, list[str]]:
    """Samples `items` with `plan` in batches of `batch_size`, scores each sample with `reward` (per sample: its group
    stage runs after the gather) and hands each batch, with its reward artifacts, to `writers`. Each item is its own
    group, numbered from `first_group`. Returns the reward result (``scores`` `[n]`, ``components`` each `[n]`, plus
    ``completion_tokens`` `[n]` for policies that write text, ``features`` `[n, ...]` or `None`, on the CPU, in the
    reward's dtypes) and the prompts (`n`). `progress` shows a progress bar over the samples on a terminal (none in a
    log file)."""
    import sys

    from tqdm.auto import tqdm

    scores, components, features, prompts = [], {}, [], []
    # a bar closed on errors too: a run's last line is its error, not a half-drawn bar
    with tqdm(total=len(items), desc="eval", unit="sample", disable=not (progress and sys.stderr.isatty()),
              leave=False) as bar:
        for start in range(0, len(items), batch_size):
            batch = items_to_batch(items[start : start + batch_size])
            batch.group_ids = torch.arange(len(batch)) + first_group + start
            rollout = policy.sample(batch, plan, generator=generator)
            result = reward(rollout.outputs, batch)
            scores.append(result.scores.cpu())
            for name, value in result.components.items():
                components.setdefault(name, []).append(value.cpu())
            tokens = rollout.outputs.get("num_tokens")  # [n] text policies: completion lengths (e.g. think or not)
            if isinstance(tokens, torch.Tensor) and "completion_tokens" not in result.components:
                components.setdefault("completion_tokens", []).append(tokens.float().cpu())
            if result.features is not None:
                features.append(result.features.cpu())
            prompts += batch.prompts
            for writer in writers:
                writer.add(rollout.outputs, batch, result.artifacts)  # what the reward declares for the writers
            bar.update(len(batch))
    return RewardResult(scores=torch.cat(scores), components={k: torch.cat(v) for k, v in components.items()},
                        features=torch.cat(features) if features else None), prompts


def finite_mean(values: torch.Tensor) -> float:
    """The mean of the finite entries of `values` (NaN when there is none)."""
    values = values[torch.isfinite(values)]
    return values.float().mean().item() if values.numel() else float("nan")


def reward_metrics(scores: torch.Tensor, group_ids: torch.Tensor, components: dict) -> dict[str, float]:
    """A training step's reward metrics from the gathered `scores` `[N]` (after the group stage), `group_ids` `[N]` and
    `components` (each `[N]`): ``reward/mean`` and ``reward/std`` of the finite scores, ``reward/invalid`` (samples
    without a finite score), ``reward/zero_std_groups`` (the share of groups whose finite scores are all equal) and
    ``reward/<component>`` (each component's finite mean)."""
    finite = torch.isfinite(scores)
    groups = [scores[(group_ids == g) & finite] for g in torch.unique(group_ids)]
    stds = torch.tensor([float(g.std(unbiased=False)) for g in groups if g.numel()])  # [groups with valid scores]
    metrics = {
        "reward/mean": finite_mean(scores),
        "reward/std": scores[finite].std().item() if finite.sum() > 1 else 0.0,
        "reward/invalid": float((~finite).sum()),
        "reward/zero_std_groups": float((stds < 1e-8).float().mean()) if stds.numel() else 0.0,
    }
    for name, values in components.items():
        metrics[f"reward/{name}"] = finite_mean(values.float().cpu())
    return metrics


def kind_metrics(per_item: list[tuple[str, float, float, int]], items: list[dict], metric: str,
                 prefix: str) -> dict[str, float]:
    """The headline metric's mean over the evaluated items of each kind (``item["metadata"]["kind"]``, a string), as
    ``<prefix>kind/<kind>/<metric>``; NaN values are left out. Empty unless the items hold 2 to `KIND_LIMIT` kinds.

    Args:
        per_item (`list[tuple[str, float, float, int]]`): ``(prompt, reward, metric, index)`` per evaluated item, its
            index in `items`.
        items (`list[dict]`): the split's held-out items.
        metric (`str`), prefix (`str`): the headline metric's name and the split's metric prefix (``eval/``).
    """
    values: dict[str, list[float]] = {}
    for _, _, value, index in per_item:
        metadata = items[index].get("metadata")
        kind = metadata.get("kind") if isinstance(metadata, dict) else None
        if isinstance(kind, str) and value == value:
            values.setdefault(kind, []).append(value)
    if not 2 <= len(values) <= KIND_LIMIT:
        return {}
    return {f"{prefix}kind/{kind}/{metric}": sum(v) / len(v) for kind, v in sorted(values.items())}


def gather_rewards(accelerator, result: RewardResult, group_ids: torch.Tensor,
                   group_stage=None) -> tuple[RewardResult, torch.Tensor]:
    """Gathers this process's reward `result` (``scores`` `[n]`, ``components`` each `[n]`, ``features`` `[n, ...]`)
    and `group_ids` `[n]` from every process (a group may span processes), then applies the reward's `group_stage`
    (see [`mmgrpo.protocols.RewardFn`]) to the whole batch. Returns ``(result [N], groups [N])``: the final scores, in
    the dtype the reward gave, and the global groups. The result's ``artifacts`` are not gathered: the sample writers
    take them from each process's own result."""

    def gather(values: torch.Tensor) -> torch.Tensor:  # [n, ...] on every process -> [N, ...], rank order
        return accelerator.gather(values.to(accelerator.device)).cpu()

    groups = gather(group_ids)  # [N]
    whole = RewardResult(
        scores=gather(result.scores),  # [N]
        components={name: gather(values) for name, values in result.components.items()},
        features=None if result.features is None else gather(result.features),
    )
    return (whole if group_stage is None else group_stage(whole, groups)), groups


def evaluate_splits(policy, reward, splits: dict[str, list], eval_config, accelerator, output_dir, step: int,
                    trackers=None, batch_size: int = 64) -> dict[str, float]:
    """[`evaluate_held_out`] of each held-out split of `splits` (name -> items); returns every split's metrics.

    Raises:
        `ValueError`: two splits log a metric of the same name (an ``eval.rewards`` entry named after a split).
    """
    out: dict[str, float] = {}
    for split, items in splits.items():
        metrics = evaluate_held_out(policy, reward, items, eval_config, accelerator, output_dir, step, trackers,
                                    batch_size, split)
        clash = sorted(set(metrics) & set(out))
        if clash:
            raise ValueError(f"eval.splits: held-out split {split!r} logs {clash[0]}, which another split logs too: "
                             "rename the eval.rewards entry (or reward component) named after the split.")
        out.update(metrics)
    return out


@torch.no_grad()
def evaluate_held_out(policy, reward, items: list, eval_config, accelerator, output_dir, step: int, trackers=None,
                      batch_size: int = 64, split: str = DEFAULT_SPLIT) -> dict[str, float]:
    """Deterministic samples of the first ``eval_config.num_prompts`` held-out `items` (same noise every time), each its
    own group, scored by `reward`: the reward means (after its group stage, on every process's items) as
    ``eval/score`` and ``eval/<component>`` (``eval/<split>/...`` for another split than ``eval``), the scores per
    prompt (``<output_dir>/eval/step_*.json``, or ``eval/<split>/``) and the samples, written by the writers of the
    policy's output modalities ([`mmgrpo.sample_writers`]) on the main process (in ``samples/``, or
    ``samples/<split>/``) and, for the ``eval`` split, handed to `trackers`."""
    from accelerate.utils import gather_object

    from .sample_writers import writers_for
    from .visualize import write_per_prompt_scores

    world, rank = accelerator.num_processes, accelerator.process_index
    writers = writers_for(policy.modalities, eval_config.grid_size, reward.artifacts)
    mine, first = process_share(items[: eval_config.num_prompts], world, rank)
    plan = evaluation_plan(policy)
    generator = torch.Generator()
    generator.manual_seed(mix_seed(eval_config.seed, rank))
    local, prompts = sample_and_score(policy, reward, mine, plan, generator, writers, first, batch_size,
                                      progress=accelerator.is_main_process)
    whole, _ = gather_rewards(accelerator, local, torch.arange(len(prompts)) + first, reward.group_stage)  # [N]
    prefix = "eval/" if split == DEFAULT_SPLIT else f"eval/{split}/"
    out = {prefix + "score": finite_mean(whole.scores.float())}
    for name, values in whole.components.items():
        out[prefix + name] = finite_mean(values.float())
    n = len(prompts)
    scores = whole.scores[rank * n : (rank + 1) * n]  # [n] this process's
    metric = whole.components.get(eval_config.metric, whole.scores)[rank * n : (rank + 1) * n]  # [n] headline
    per_item = list(zip(prompts, scores.tolist(), metric.tolist(), range(first, first + n)))  # held-out indices
    per_item = gather_object(per_item) if world > 1 else per_item
    out.update(kind_metrics(per_item, items, eval_config.metric, prefix))
    if accelerator.is_main_process:
        write_per_prompt_scores(per_item, split_path(Path(output_dir) / "eval", split) / f"step_{step:05d}.json",
                                eval_config.metric)
        for writer in writers:  # this process's first samples
            paths = writer.write(split_path(Path(output_dir) / "samples", split), step,
                                 scores[: eval_config.grid_size].tolist())
            if trackers and split == DEFAULT_SPLIT:
                trackers.log_samples(paths, step)
    return out
