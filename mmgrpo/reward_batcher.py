"""Batching of concurrent ``/score`` requests for the reward server (`mmgrpo.reward_server`).

One scoring thread owns the reward. Requests from the server's worker threads join a queue; whenever the reward is
free, the scoring thread takes the oldest request and, in arrival order, every other waiting request that can be merged
with it, while the merged batch holds at most `max_batch` samples. When the reward was idle and nothing else waits, it
first waits up to `batch_wait` seconds for more requests (a partial batch then runs). The merged batch is scored in one
call of the reward and each request gets back its own slice of the scores and components.

The values are those of scoring each request alone: a reward without a group stage (the only kind the server serves,
`mmgrpo.protocols.RewardFn`) scores each sample by itself. Each request keeps its own prompts, metadata and
conditions, and its group ids are renumbered so that groups never join across requests (two training processes send
the same global ids for parts of one group; a reward that looks at groups in its call sees each request's groups as
when scored alone). Requests merge only when the merge is valid ([`merge_key`]): the same output keys, each output a
list or a tensor with one entry per sample (tensors of the same dtype and per-sample shape), the same condition keys,
and group ids and member ids present in all or none. Any other request, or one larger than `max_batch`, is scored
alone. When a merged call raises, each of its requests is scored again alone, so that only the faulty one fails.

Bounds: at most `max_queue` requests wait (not counting those being scored); beyond it [`QueueFull`] (the server
answers 503). Counters (requests, reward calls, samples, largest batch, refusals, waiting requests) are reported by
``GET /info`` under ``"stats"``.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch

from .types import PromptBatch, RewardResult


class QueueFull(RuntimeError):
    """The batcher's queue holds `max_queue` requests already (the server answers 503)."""


@dataclass(eq=False)  # compared by identity (its tensors have no truth value)
class _Job:
    outputs: dict[str, Any]
    batch: PromptBatch
    key: tuple | None  # None: never merged
    done: threading.Event = field(default_factory=threading.Event)
    result: RewardResult | None = None
    error: BaseException | None = None


def merge_key(outputs: dict[str, Any], batch: PromptBatch) -> tuple | None:
    """What two requests must share to be merged: each output's key, kind, dtype and per-sample shape, the condition
    keys, and whether group and member ids are given; `None` when the request cannot be merged with any (an output or
    condition that is not one entry per sample)."""
    n, parts = len(batch), []
    if n == 0 or not isinstance(outputs, dict):
        return None
    for name in sorted(outputs):
        value = outputs[name]
        if isinstance(value, torch.Tensor) and value.dim() >= 1 and value.shape[0] == n:
            parts.append((name, "tensor", str(value.dtype), tuple(value.shape[1:])))
        elif isinstance(value, list) and len(value) == n:
            parts.append((name, "list"))
        else:
            return None
    if not all(isinstance(v, list) and len(v) == n for v in batch.conditions.values()):
        return None
    return (tuple(parts), tuple(sorted(batch.conditions)), batch.group_ids is None, batch.member_ids is None)


def _renumbered(group_ids: torch.Tensor, first: int) -> torch.Tensor:
    """`group_ids` `[n]` as consecutive ids from `first`, in order of first appearance kept by `unique`."""
    _, inverse = torch.unique(group_ids, return_inverse=True)  # [n], ids 0..k-1
    return inverse + first


def merge(jobs: list[_Job]) -> tuple[dict[str, Any], PromptBatch]:
    """The outputs and batch of `jobs` (same [`merge_key`]) concatenated in order, group ids renumbered per job."""
    first = jobs[0]
    outputs = {}
    for name, value in first.outputs.items():
        parts = [job.outputs[name] for job in jobs]
        outputs[name] = torch.cat(parts) if isinstance(value, torch.Tensor) else [x for part in parts for x in part]
    group_ids, offset = None, 0
    if first.batch.group_ids is not None:
        renumbered = []
        for job in jobs:
            renumbered.append(_renumbered(job.batch.group_ids, offset))
            offset = int(renumbered[-1].max()) + 1 if len(renumbered[-1]) else offset
        group_ids = torch.cat(renumbered)  # [N]
    batch = PromptBatch(
        prompts=[p for job in jobs for p in job.batch.prompts],
        metadata=[m for job in jobs for m in job.batch.metadata],
        group_ids=group_ids,
        conditions={k: [x for job in jobs for x in job.batch.conditions[k]] for k in first.batch.conditions},
        member_ids=None if first.batch.member_ids is None else torch.cat([job.batch.member_ids for job in jobs]),
    )
    return outputs, batch


def split(result: RewardResult, sizes: list[int]) -> list[RewardResult]:
    """The scores and components of a merged batch, one [`RewardResult`] per request of `sizes` samples."""
    total = sum(sizes)
    wrong = [k for k, v in {"scores": result.scores, **result.components}.items() if tuple(v.shape) != (total,)]
    if wrong:
        raise ValueError(f"the reward returned {', '.join(wrong)} of a shape other than [{total}] for {total} samples")
    scores = result.scores.split(sizes)
    components = {k: v.split(sizes) for k, v in result.components.items()}
    return [RewardResult(scores=scores[i], components={k: v[i] for k, v in components.items()})
            for i in range(len(sizes))]


class RequestBatcher:
    """Scores requests on one thread, merging concurrent ones (see the module docstring).

    Args:
        reward: any `RewardFn` without a group stage.
        max_batch (`int`): most samples in one call of the reward (1: no merging).
        batch_wait (`float`): seconds to wait for more requests when one arrives at an idle reward.
        max_queue (`int`): most requests waiting; beyond it [`QueueFull`].
    """

    def __init__(self, reward, max_batch: int, batch_wait: float, max_queue: int):
        self.reward, self.max_batch, self.batch_wait, self.max_queue = reward, max_batch, batch_wait, max_queue
        self._queue: deque[_Job] = deque()
        self._cond = threading.Condition()
        self._stopped = False
        self._counts = {"requests": 0, "reward_calls": 0, "samples": 0, "largest_batch": 0, "refused_busy": 0}
        self._thread = threading.Thread(target=self._loop, name="mmgrpo-reward-scorer", daemon=True)
        self._thread.start()

    def stats(self) -> dict[str, int]:
        """Requests scored, reward calls, samples scored, the largest call, requests refused (503), requests waiting."""
        with self._cond:
            return {**self._counts, "waiting": len(self._queue)}

    def score(self, outputs: dict[str, Any], batch: PromptBatch) -> RewardResult:
        """Scores one request (from a server worker thread): waits for its turn and returns its own result; raises
        [`QueueFull`] when `max_queue` requests wait already, or what the reward raised on it."""
        job = _Job(outputs, batch, merge_key(outputs, batch))
        with self._cond:
            if len(self._queue) >= self.max_queue:
                self._counts["refused_busy"] += 1
                raise QueueFull(f"the reward server is busy: {len(self._queue)} requests already wait to be scored "
                                f"(--max-queue {self.max_queue}); retry later, or restart the server with a larger "
                                f"--max-queue or --max-batch")
            self._queue.append(job)
            self._cond.notify_all()
        job.done.wait()
        if job.error is not None:
            raise job.error
        return job.result

    def stop(self) -> None:
        """Ends the scoring thread once the batch in progress is done; waiting requests fail."""
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        self._thread.join(timeout=5)

    def _take(self) -> list[_Job]:
        """The next batch of jobs (with the lock held): the oldest and the later ones that merge with it and fit."""
        head = self._queue.popleft()
        taken, size = [head], len(head.batch)
        if head.key is None or size >= self.max_batch:
            return taken
        left = deque()
        for job in self._queue:
            if job.key == head.key and size + len(job.batch) <= self.max_batch:
                taken.append(job)
                size += len(job.batch)
            else:
                left.append(job)
        self._queue = left  # in arrival order
        return taken

    def _loop(self) -> None:
        idle = True  # whether the reward has been idle since its last batch: then wait `batch_wait` for more
        while True:
            with self._cond:
                while not self._queue and not self._stopped:
                    idle = True
                    self._cond.wait()
                if self._stopped:
                    for job in self._queue:
                        job.error = QueueFull("the reward server is stopping")
                        job.done.set()
                    self._queue.clear()
                    return
                if idle and self.batch_wait > 0 and self.max_batch > 1:
                    deadline = time.monotonic() + self.batch_wait
                    while (not self._stopped and sum(len(j.batch) for j in self._queue) < self.max_batch
                           and (left := deadline - time.monotonic()) > 0):
                        self._cond.wait(left)
                jobs = self._take()
            idle = False
            self._run(jobs)

    def _call(self, jobs: list[_Job]) -> None:
        """One call of the reward on `jobs` merged; each job gets its slice (raises what the reward raised)."""
        outputs, batch = (jobs[0].outputs, jobs[0].batch) if len(jobs) == 1 else merge(jobs)
        with self._cond:
            self._counts["reward_calls"] += 1
            self._counts["largest_batch"] = max(self._counts["largest_batch"], len(batch))
        results = split(self.reward(outputs, batch), [len(job.batch) for job in jobs])
        for job, result in zip(jobs, results):
            job.result = result

    def _run(self, jobs: list[_Job]) -> None:
        """Scores `jobs` in one call, or each alone when the merged call raised; always releases every job."""
        try:
            try:
                self._call(jobs)
            except Exception as err:
                if len(jobs) == 1:
                    jobs[0].error = err
                else:
                    for job in jobs:
                        self._run([job])
        finally:
            with self._cond:
                self._counts["requests"] += sum(job.result is not None for job in jobs if not job.done.is_set())
                self._counts["samples"] += sum(len(job.batch) for job in jobs
                                               if job.result is not None and not job.done.is_set())
            for job in jobs:
                job.done.set()
