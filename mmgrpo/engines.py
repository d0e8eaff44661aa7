"""Rollout engines: what samples the rollouts the trainer trains on.

A [`RolloutEngine`] returns the policy's [`~mmgrpo.types.Rollout`] of a prompt batch under a sampling plan, with
everything the trainer replays (``trajectory``), and, when its numerics are not the trainer's own forward (another
kernel, another dtype: vLLM, SGLang), the log-probs it computed for the sampled transitions in
``Rollout.engine_log_probs``. The trainer then applies the algorithm's rollout correction
([`mmgrpo.rollout_correction`]) before it updates. An engine that holds its own copy of the weights takes the policy's
after every step's updates (``sync_weights``; the trainer calls it only for an engine that declares
``holds_weights``), so that the next rollouts come from the new weights.

[`LocalEngine`] is the policy's own ``sample`` (the trainer's forward: no engine log-probs, nothing to sync), the
default and the reference. A vLLM or SGLang engine (colocated, asleep while the trainer updates, or a server whose
weights are pushed through its update API) implements the same members; ``rollout.engine`` in the config chooses it
([`mmgrpo.engine_builders.build_engine`]).

A pipeline an engine samples for declares the ``engine_rollout`` capability and implements these members:
``engine_prompts(batch)`` (one [`EnginePrompt`] per sample: the prompt's token ids as an engine takes them and its
vision inputs exactly as the trainer's processor saw them), ``engine_sampling(plan)`` (an [`EngineSampling`]),
``engine_rollout(batch, prompts, tokens, log_probs, steps)`` (the replayable [`~mmgrpo.types.Rollout`] of the engine's
completions, ``engine_log_probs`` set), ``engine_model()`` (the base model an engine loads),
``engine_weights()`` (the current weights by checkpoint name, a LoRA merged in) and ``engine_weights_to(path,
adapter)`` (the same on disk, or the LoRA adapter alone).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

from .plans import SamplingPlan
from .types import PromptBatch, Rollout


@runtime_checkable
class RolloutEngine(Protocol):
    """Samples rollouts for the trainer (see the module docstring)."""

    name: str
    holds_weights: bool  # whether it samples from its own copy of the weights (then ``sync_weights`` after updates)

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
    holds_weights = False

    def __init__(self, policy):
        self.policy = policy

    def sample(self, batch: PromptBatch, plan: SamplingPlan, *, generator: torch.Generator | None = None) -> Rollout:
        return self.policy.sample(batch, plan, generator=generator)

    def sync_weights(self, policy) -> None:
        """Nothing to do: the engine is the policy."""


@dataclass
class EnginePrompt:
    """One sample's prompt as an engine takes it.

    Args:
        prompt_ids (`list[int]`): the chat template's tokens with one placeholder token per image (the engine's
            processor expands it to the image's tokens, as the trainer's processor did).
        images (`list`): the images (PIL), already resized as the trainer's processor saw them.
        processor_kwargs (`dict`): the processor options an engine passes on (the pixel budget).
        expanded_ids (`list[int]`): the trainer's prompt tokens (placeholders expanded): what the engine must see.
        encoded (`dict`): the trainer's encoded prompt, which the rollout's replay reads (one object per group).
    """

    prompt_ids: list[int]
    images: list = field(default_factory=list)
    processor_kwargs: dict[str, Any] = field(default_factory=dict)
    expanded_ids: list[int] = field(default_factory=list)
    encoded: Any = None


@dataclass(frozen=True)
class EngineSampling:
    """How an engine samples one rollout: up to `max_tokens` tokens at `temperature` (greedy when `greedy`),
    truncated to `top_k` (0: all) and `top_p`, stopping after any of `stop_ids`, never drawing `suppress_ids` (tokens
    outside the policy's support, which the trainer scores at probability 0: sent as a logit bias of -100)."""

    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    greedy: bool
    stop_ids: tuple[int, ...]
    suppress_ids: tuple[int, ...] = ()
