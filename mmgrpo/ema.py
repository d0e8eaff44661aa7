"""An exponential moving average of a policy's trainable parameters that can stand in for them (DGPO's fast-EMA
"old" model; DiffusionNFT's old model and AWM's EMA, stepped once per training step), with a state dict for exact
resume.

Under FSDP2 (``train.sharding: fsdp``) the parameters are sharded DTensors and so is the shadow: each process
averages its own shard. The state dict holds the full tensors (every process calls it: each shadow tensor is
gathered), so a run resumes at any number of processes."""

from __future__ import annotations

import contextlib

import torch

from . import sharding


class ParameterEMA:
    """Shadow copies ``s <- decay * s + (1 - decay) * p`` of a list of parameters.

    The shadow is created from the parameters on first use (so on their device and in their layout, after
    ``prepare``), or restored by [`~ParameterEMA.load_state_dict`] (full tensors, put in the parameters' layout, a
    shard of each when they are sharded, on first use).
    """

    def __init__(self):
        self.shadow: list[torch.Tensor] | None = None
        self.owed: list[float] = []  # the decays of the steps owed (see `owe`), oldest first

    def owe(self, decay: float) -> None:
        """Records one EMA step of `decay` towards the parameters as they are now, taken by [`settle`] before the
        shadow is next read: an algorithm that steps its EMA at the end of a training step (which hands it no
        parameters) owes the step, and the parameters do not change before the next read (the next step's first
        scoring), so the step is the same."""
        self.owed.append(float(decay))

    def settle(self, parameters) -> None:
        """Takes the owed steps, oldest first, towards the current `parameters`."""
        parameters = list(parameters)
        for decay in self.owed:
            self.update(parameters, decay)
        self.owed = []

    def _ensure(self, parameters: list[torch.nn.Parameter]) -> list[torch.Tensor]:
        if self.shadow is None:
            self.shadow = [p.detach().clone() for p in parameters]
        if len(self.shadow) != len(parameters):
            raise ValueError(f"The EMA holds {len(self.shadow)} tensors but the policy has {len(parameters)}.")
        self.shadow = [s if sharding.is_sharded(s) else sharding.like(s, p) for s, p in zip(self.shadow, parameters)]
        return self.shadow

    @torch.no_grad()
    def update(self, parameters, decay: float) -> None:
        """One EMA step towards the current `parameters` (``decay=0`` copies them)."""
        parameters = list(parameters)
        for shadow, param in zip(self._ensure(parameters), parameters):
            shadow.add_(param.detach().to(shadow.dtype) - shadow, alpha=1.0 - decay)

    @contextlib.contextmanager
    def swapped(self, parameters):
        """Inside, the parameters hold the EMA values; their own values are restored on exit (bit for bit).

        Yields:
            `list[torch.Tensor]`: the parameters' own values, kept aside until the exit (read them, do not change them).
        """
        parameters = list(parameters)
        shadow = self._ensure(parameters)
        saved = [p.detach().clone() for p in parameters]
        with torch.no_grad():
            for param, value in zip(parameters, shadow):
                param.copy_(value)
        try:
            yield saved
        finally:
            with torch.no_grad():
                for param, value in zip(parameters, saved):
                    param.copy_(value)

    def state_dict(self) -> dict:
        """``{"shadow": [full tensors on the CPU] or None, "owed": [decays]}``; with sharded parameters every process must
        call it."""
        if self.shadow is None:
            return {"shadow": None, "owed": list(self.owed)}
        return {"shadow": [sharding.full_tensors(s.detach()).cpu() for s in self.shadow], "owed": list(self.owed)}

    def load_state_dict(self, state: dict) -> None:
        self.shadow = None if state["shadow"] is None else [s.clone() for s in state["shadow"]]
        self.owed = list(state.get("owed", []))  # checkpoints written before owed steps existed owe none
