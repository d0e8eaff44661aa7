"""Rollout engines: what samples the rollouts the trainer trains on.

A [`RolloutEngine`] returns the policy's [`~mmgrpo.types.Rollout`] of a prompt batch under a sampling plan, with
everything the trainer replays (``trajectory``), and, when its numerics are not the trainer's own forward (another
kernel, another dtype: vLLM, SGLang), the log-probs it computed for the sampled transitions in
``Rollout.engine_log_probs``. The trainer then applies the algorithm's rollout correction
([`mmgrpo.rollout_correction`]) before it updates. An engine that holds its own copy of the weights takes the policy's
after every step's updates (``sync_weights``; the trainer calls it once such an engine exists), so that the next
rollouts come from the new weights.

[`LocalEngine`] is the policy's own ``sample`` (the trainer's forward: no engine log-probs, nothing to sync), the
default and the reference. A vLLM or SGLang engine (colocated, asleep while the trainer updates, or a server whose
weights are pushed through its update API) implements the same two members; ``rollout.engine`` in the config will
choose it.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from .plans import SamplingPlan
from .types import PromptBatch, Rollout


@runtime_checkable
class RolloutEngine(Protocol):
    """Samples rollouts for the trainer (see the module docstring)."""

    name: str

    def sample(self, batch: PromptBatch, plan: SamplingPlan, *, generator: torch.Generator | None = None) -> Rollout:
        """The rollout of `batch` under `plan`, replayable by the trainer's policy; ``engine_log_probs`` `[N, S]` set
        when the engine's log-probs are not the trainer's forward's (``old_log_probs`` then holds them too)."""
        ...

    def sync_weights(self, policy) -> None:
        """Takes the policy's current trainable weights (after a step's optimizer updates)."""
        ...


class LocalEngine:
    """The policy samples itself, with the trainer's own forward: no engine log-probs, no weights to sync.

    Args:
        policy ([`~mmgrpo.protocols.StochasticPolicy`]): the trained policy.
    """

    name = "local"

    def __init__(self, policy):
        self.policy = policy

    def sample(self, batch: PromptBatch, plan: SamplingPlan, *, generator: torch.Generator | None = None) -> Rollout:
        return self.policy.sample(batch, plan, generator=generator)

    def sync_weights(self, policy) -> None:
        """Nothing to do: the engine is the policy."""
