"""The per-batch work of an evaluation, outside the trainer: which held-out items a process takes, and sampling and
scoring them batch by batch while the sample writers keep the first ones. [`mmgrpo.trainer.Trainer.evaluate`] gathers
the results, applies the reward's group stage and writes the scores and samples."""

from __future__ import annotations

import torch

from .prompt_stream import items_to_batch
from .types import RewardResult, SamplingPlan


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


@torch.no_grad()
def sample_and_score(policy, reward, items: list, plan: SamplingPlan, generator: torch.Generator, writers: list,
                     first_group: int = 0, batch_size: int = 64, progress: bool = False) -> tuple[RewardResult, list[str]]:
    """Samples `items` with `plan` in batches of `batch_size`, scores each sample with `reward` (per sample: its group
    stage runs after the gather) and hands each batch to `writers`. Each item is its own group, numbered from
    `first_group`. Returns the reward result (``scores`` `[n]`, ``components`` each `[n]`, plus ``completion_tokens``
    `[n]` for policies that write text, ``features`` `[n, ...]` or `None`, on the CPU, in the reward's dtypes) and the prompts (`n`). `progress` shows a progress bar over the
    samples."""
    from tqdm.auto import tqdm

    scores, components, features, prompts = [], {}, [], []
    bar = tqdm(total=len(items), desc="eval", unit="sample", disable=not progress, leave=False)
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
            writer.add(rollout.outputs, batch)
        bar.update(len(batch))
    bar.close()
    return RewardResult(scores=torch.cat(scores), components={k: torch.cat(v) for k, v in components.items()},
                        features=torch.cat(features) if features else None), prompts
