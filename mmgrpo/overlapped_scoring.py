"""Rewards scored while the next part of the rollout batch samples (``train.sample_chunks``, ``train.overlap_scoring``).

With ``train.sample_chunks: K`` (default 1: one ``sample`` call, then one reward call), each process samples its `n`
samples of a step in `K` consecutive chunks of ``n / K`` samples, in batch order. With ``train.overlap_scoring: true``
(the default) chunk `k`'s outputs are scored by the reward in a worker thread while chunk `k + 1` samples, and the
last chunk's while the trainer's rollout correction runs; with ``false`` each chunk is scored in the trainer's thread
right after it is sampled. The chunks' rollouts and reward results are then joined in batch order ([`cat_rollouts`],
[`cat_results`]) and the step goes on as with one chunk: the reward's group stage, gather and advantages see the whole
batch.

**Same values.** The reward is called with the same chunks, in the same order, one call at a time, in both modes, so
a step's statistics are the same bit for bit with and without overlap (tested). Chunk `k` samples with its own CPU
generator, seeded from a draw of the step's generator made before the first chunk (``K`` 63-bit seeds), so its noise
does not depend on when the reward runs; the step's generator then goes on to the updates. Draws keyed by group id (a
group's shared initial noise) are the same in any chunk. Against one chunk (``K = 1``) the per-sample noise differs
(other streams) and numerics that depend on the batch size (a batched matmul) may differ in the last bits.

**What overlaps.** The reward runs in one worker thread: a model reward on the GPU, or a CPU reward whose work releases
the GIL (torch ops, image codecs, HTTP: ``remote``, ``judge``); pure-Python work only interleaves. The reward must not
draw from global random number generators that sampling also draws from (the built-in rewards draw none), and must
not keep state that sampling reads.

**Joining rollouts.** Tensors and lists with one entry per sample are concatenated; other entries (``shared_*``
trajectory entries, scalars) must be equal in every chunk and are kept once. Pipelines that encode each distinct
prompt once (``prompt_index`` `[N]` into ``shared_<key>`` `[U, ...]`, the negative prompt in ``shared_negative_<key>``
`[1, ...]`: `wan`, `hunyuan_video15`, `ltx2`) get those tables concatenated and ``prompt_index`` shifted; a table is a
``shared_*`` tensor of two or more dimensions with one row per distinct prompt of each chunk (the samplers' shared
entries, sigmas and noise levels, are one-dimensional). A
pipeline whose rollouts join declares the ``chunked_rollouts`` capability (tested for each on its tiny model); one that
pads each batch to its longest prompt (``qwen_image``, ``qwen_image_edit``, ``z_image``, ``mdlm``) does not, and
``train.sample_chunks`` > 1 is refused for it before any model loads ([`check_pipeline`]).
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

import torch

from . import registry
from .types import PromptBatch, RewardResult, Rollout
from .validation import ConfigError

CAPABILITY = "chunked_rollouts"  # a pipeline whose rollouts of consecutive chunks join ([`cat_rollouts`])
INDEX_KEY = "prompt_index"  # [N] rows of the shared_<key> entries (see the module docstring)


def check_pipeline(config) -> None:
    """Refuses ``train.sample_chunks`` > 1 for a pipeline that does not declare the ``chunked_rollouts`` capability
    (its rollouts pad each batch to its longest prompt, so chunks do not join), before any model loads."""
    if config.train.sample_chunks == 1 or CAPABILITY in registry.get("pipeline", config.pipeline.name).capabilities:
        return
    able = sorted(n for n in registry.available("pipeline") if CAPABILITY in registry.get("pipeline", n).capabilities)
    raise ConfigError(f"train.sample_chunks: pipeline {config.pipeline.name} pads each batch to its longest prompt, so "
                      f"its rollouts cannot be sampled in chunks: set train.sample_chunks: 1 (pipelines that can: "
                      f"{', '.join(able)}).")


def check_chunks(chunks: int, local_n: int) -> None:
    """Refuses ``train.sample_chunks`` that does not split this process's `local_n` samples per step evenly."""
    if local_n % chunks:
        raise ConfigError(f"train.sample_chunks: {chunks} does not divide the {local_n} samples each process draws per "
                          "step (prompts_per_step x group_size / processes): use a divisor of it, or 1.")


class PendingScores:
    """The reward result of a step's rollout, joined from its chunks' when [`result`] is called.

    Args:
        parts: each chunk's scores: a future of the worker thread, or a function that returns them.
        exposed_s (`float`): seconds the caller's thread already spent in reward calls (synchronous chunks); [`result`]
            adds the time it takes (calls, or waiting for the worker).
    """

    def __init__(self, parts: list[Future | Callable[[], RewardResult]], exposed_s: float = 0.0):
        self.parts, self.exposed_s = parts, exposed_s

    def result(self) -> RewardResult:
        """Waits for every chunk's scores (a reward's error is raised here) and joins them in batch order."""
        start = time.perf_counter()
        results = [part.result() if isinstance(part, Future) else part() for part in self.parts]
        self.exposed_s += time.perf_counter() - start
        return cat_results(results)


def _score_with(reward, outputs: dict[str, Any], batch: PromptBatch, grad: bool) -> RewardResult:
    """`reward` on one chunk, in the worker thread, with the caller's grad mode (thread-local in torch)."""
    with torch.set_grad_enabled(grad):
        return reward(outputs, batch)


class ChunkedScoring:
    """Samples a step's rollout in chunks and scores each chunk as soon as it is sampled (see the module docstring).

    Args:
        chunks (`int`): ``train.sample_chunks``; must divide `local_n`.
        overlap (`bool`): ``train.overlap_scoring``: score in a worker thread while the next chunk samples.
        local_n (`int`): this process's samples per step.
    """

    def __init__(self, chunks: int, overlap: bool, local_n: int):
        check_chunks(chunks, local_n)
        self.chunks, self.overlap = chunks, overlap
        self._pool: ThreadPoolExecutor | None = None  # one worker: the reward is never called twice at once
        self.last: PendingScores | None = None  # the last step's scores (its `exposed_s`: the reward time not hidden)

    def sample(self, engine, reward, batch: PromptBatch, plan,
               generator: torch.Generator) -> tuple[Rollout, PendingScores]:
        """The rollout of `batch` under `plan` from `engine` and its pending reward result (``result()``)."""
        if self.chunks == 1:  # the one-call path: the reward runs when the trainer asks for the result
            rollout = engine.sample(batch, plan, generator=generator)
            self.last = PendingScores([lambda: reward(rollout.outputs, batch)])
            return rollout, self.last
        seeds = torch.randint(0, 2**63 - 1, (self.chunks,), generator=generator).tolist()  # [K], before any chunk
        size, grad = len(batch) // self.chunks, torch.is_grad_enabled()
        rollouts, parts, exposed = [], [], 0.0
        for k, seed in enumerate(seeds):
            piece = batch.select(range(k * size, (k + 1) * size))
            rollout = engine.sample(piece, plan, generator=torch.Generator().manual_seed(seed))
            rollouts.append(rollout)
            if self.overlap:
                self._pool = self._pool or ThreadPoolExecutor(max_workers=1, thread_name_prefix="mmgrpo-chunk-scoring")
                parts.append(self._pool.submit(_score_with, reward, rollout.outputs, piece, grad))
            else:
                start = time.perf_counter()
                result = reward(rollout.outputs, piece)
                exposed += time.perf_counter() - start
                parts.append(lambda result=result: result)
        self.last = PendingScores(parts, exposed)
        return cat_rollouts(rollouts), self.last

    def close(self) -> None:
        """Stops the scoring worker, if one was started (after the last step's scores were read)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


# ------------------------------------------------------------------------------------------------------- joining
def _join(key: str, values: list, sizes: list[int]):
    """One entry of several chunks: concatenated when it has one item per sample in each (never a ``shared_*`` one,
    as [`~mmgrpo.types.Rollout.select`] keeps those whole), else kept once if equal in every chunk."""
    first, shared = values[0], key.startswith("shared_")
    per_sample = [isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == n for v, n in zip(values, sizes)]
    if not shared and all(per_sample):
        if len({tuple(v.shape[1:]) for v in values}) > 1:
            raise ValueError(f"rollout entry {key!r} has per-sample shapes {[tuple(v.shape[1:]) for v in values]} in "
                             "different chunks (the pipeline pads each batch to its longest item): set "
                             "train.sample_chunks: 1 for this pipeline.")
        return torch.cat(values)
    if not shared and all(isinstance(v, list) and len(v) == n for v, n in zip(values, sizes)):
        return [item for v in values for item in v]
    same = all(torch.equal(first, v) if isinstance(first, torch.Tensor) and isinstance(v, torch.Tensor)
               else type(first) is type(v) and first == v for v in values[1:])
    if not same:
        raise ValueError(f"rollout entry {key!r} is shared by the samples of a chunk but differs between chunks: "
                         "this pipeline's rollouts cannot be joined; set train.sample_chunks: 1.")
    return first


def _join_indexed(trajectories: list[dict]) -> dict:
    """The ``prompt_index`` `[n]` of chunks and the tables it indexes, ``shared_<key>`` `[U, ...]` (tensors of two or
    more dimensions with one row per distinct prompt of the chunk, not ``shared_negative_*``): rows concatenated, each
    chunk's indices shifted past the rows of the chunks before it."""
    rows = [int(t[INDEX_KEY].max()) + 1 for t in trajectories]  # distinct prompts of each chunk

    def indexed(key: str) -> bool:
        return key.startswith("shared_") and not key.startswith("shared_negative_") and all(
            isinstance(t[key], torch.Tensor) and t[key].dim() >= 2 and t[key].shape[0] == u
            for t, u in zip(trajectories, rows))

    offsets = torch.tensor([0, *rows[:-1]]).cumsum(0).tolist()
    out = {INDEX_KEY: torch.cat([t[INDEX_KEY] + offset for t, offset in zip(trajectories, offsets)])}  # [N]
    for key in filter(indexed, trajectories[0]):
        out[key] = torch.cat([t[key] for t in trajectories])  # [sum U, ...]
    return out


def cat_rollouts(parts: list[Rollout]) -> Rollout:
    """The rollouts of consecutive chunks of a batch joined into the batch's (see the module docstring)."""
    if len(parts) == 1:
        return parts[0]
    sizes = [len(part) for part in parts]
    key_sets = [(tuple(p.outputs), tuple(p.trajectory)) for p in parts]
    if len(set(key_sets)) > 1:
        raise ValueError("the chunks' rollouts hold different entries: set train.sample_chunks: 1 for this pipeline.")
    outputs = {k: _join(k, [p.outputs[k] for p in parts], sizes) for k in parts[0].outputs}
    indexed = _join_indexed([p.trajectory for p in parts]) if INDEX_KEY in parts[0].trajectory else {}
    trajectory = {k: indexed[k] if k in indexed else _join(k, [p.trajectory[k] for p in parts], sizes)
                  for k in parts[0].trajectory}

    def optional(values: list[torch.Tensor | None]) -> torch.Tensor | None:
        if any(v is None for v in values) and not all(v is None for v in values):
            raise ValueError("some chunks' rollouts have engine log-probs or weights and others not.")
        return None if values[0] is None else torch.cat(values)

    return Rollout(
        group_ids=torch.cat([p.group_ids for p in parts]),
        outputs=outputs,
        old_log_probs=_join("old_log_probs", [p.old_log_probs for p in parts], sizes),
        mask=_join("mask", [p.mask for p in parts], sizes),
        trajectory=trajectory,
        engine_log_probs=optional([p.engine_log_probs for p in parts]),
        is_weights=optional([p.is_weights for p in parts]),
    )


def cat_results(parts: list[RewardResult]) -> RewardResult:
    """The reward results of consecutive chunks joined in batch order: scores, components and features concatenated,
    artifacts' lists joined."""
    if len(parts) == 1:
        return parts[0]
    first = parts[0]
    if any(set(p.components) != set(first.components) or set(p.artifacts) != set(first.artifacts)
           or (p.features is None) != (first.features is None) or p.scores_are_advantages != first.scores_are_advantages
           for p in parts):
        raise ValueError("the reward returned different components, artifacts or features for different chunks of "
                         "one step: set train.sample_chunks: 1 for this reward.")
    return RewardResult(
        scores=torch.cat([p.scores for p in parts]),  # [N]
        components={k: torch.cat([p.components[k] for p in parts]) for k in first.components},
        features=None if first.features is None else torch.cat([p.features for p in parts]),
        scores_are_advantages=first.scores_are_advantages,
        artifacts={k: [item for p in parts for item in p.artifacts[k]] for k in first.artifacts},
    )
