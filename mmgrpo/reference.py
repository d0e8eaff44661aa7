"""The trained module of a policy and its reference policy, for every adapter that trains one module.

Not a plugin: adapters compose it (`pipelines/_flow_common.py` for `sd3` / `flux` / `wan`, `pipelines/mdlm.py`,
`pipelines/qwen_vl.py`).
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
from typing import Callable, ContextManager

import torch


_REFERENCE_NEEDED = contextvars.ContextVar("mmgrpo_reference_needed", default=True)


@contextlib.contextmanager
def reference_needed(needed: bool):
    """Policies built inside this context keep a frozen reference copy (full fine-tuning) only when `needed`.

    The trainer builds the pipeline inside it with its algorithm's ``traits.needs_reference``, so a fully fine-tuned
    run whose algorithm reads no reference (no KL term) holds no second copy of the weights: at 7B that is 14 GB of
    bf16 weights. Outside the context (tests, scripts) the copy is kept.
    """
    token = _REFERENCE_NEEDED.set(needed)
    try:
        yield
    finally:
        _REFERENCE_NEEDED.reset(token)


class ReferenceSwitch:
    """What a policy's forwards run through, and its reference policy inside [`~ReferenceSwitch.reference`].

    Full fine-tuning keeps a frozen copy of the initial weights as the reference; with LoRA the reference is the same
    module with its adapter disabled (no copy).

    Args:
        module (`torch.nn.Module`): the trained module, unwrapped and already set up for training (adapter added, or
            every parameter trainable). Without LoRA, its frozen copy is taken now (unless
            built inside `reference_needed(False)`).
        disable_adapter (`Callable[[], ContextManager]`, *optional*): a context in which the module's LoRA adapter is
            off (peft's ``model.disable_adapter``); `None` means full fine-tuning.

    Attributes:
        forward (`torch.nn.Module`): the module, its DDP/FSDP wrapper after [`~ReferenceSwitch.prepare`], or the frozen
            copy inside [`~ReferenceSwitch.reference`].
        frozen (`torch.nn.Module` or `None`): the frozen initial copy (full fine-tuning, when a reference is needed).
        in_reference (`bool`): whether forwards run through the reference now (inside [`~ReferenceSwitch.reference`]).
    """

    def __init__(self, module: torch.nn.Module, disable_adapter: Callable[[], ContextManager] | None = None):
        self.module = module
        self.disable_adapter = disable_adapter
        self.full = disable_adapter is None  # full fine-tuning: the reference is a frozen copy, when one is kept
        keep = self.full and _REFERENCE_NEEDED.get()
        self.frozen = copy.deepcopy(module).requires_grad_(False).eval() if keep else None
        self.forward = module
        self.in_reference = False

    def prepare(self, accelerator) -> list[torch.nn.Module]:
        """Moves the frozen reference to the accelerator's device (sharded like the trained module under FSDP2, see
        [`mmgrpo.sharding.ShardingAccelerator`]: each process keeps its share of it) and wraps the trained module for
        distribution."""
        if self.frozen is not None:
            prepare_frozen = getattr(accelerator, "prepare_frozen", None)
            self.frozen = prepare_frozen(self.frozen) if prepare_frozen else self.frozen.to(accelerator.device)
        self.forward = accelerator.prepare_model(self.module)
        return [self.forward]

    @contextlib.contextmanager
    def reference(self):
        """Forwards run through the reference: the LoRA adapter disabled, or the frozen initial module.

        Raises:
            `RuntimeError`: a fully fine-tuned policy built without its reference copy (see [`reference_needed`]).
        """
        if self.full and self.frozen is None:
            raise RuntimeError("this fully fine-tuned policy keeps no reference copy: it was built for an algorithm "
                               "that reads no reference (no KL term). Build it outside reference_needed(False).")
        previous = self.forward, self.in_reference
        self.in_reference = True
        try:
            if self.frozen is None:
                with self.disable_adapter():
                    yield
            else:
                self.forward = self.frozen
                yield
        finally:
            self.forward, self.in_reference = previous
