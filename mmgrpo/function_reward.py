"""A plain Python function as a reward: ``reward.name: my_pkg.rewards:brightness`` where ``brightness(outputs, batch)``
returns one score per sample, as TRL takes reward callables.

The function is wrapped in a reward class ([`function_reward`]) that declares what every reward declares
([`mmgrpo.protocols.RewardFn`]): the output modalities it reads come from the ``modalities`` option (the pipeline
must produce them, checked before any model loads), it has no group stage and adds no artifacts. It is called on each
process's samples with ``outputs`` (the pipeline's outputs by modality: ``images`` `[n, 3, H, W]` in [0, 1],
``videos`` `[n, F, 3, H, W]`, ``texts`` a list of `n` strings...), ``batch`` (the [`~mmgrpo.types.PromptBatch`]:
``prompts``, ``metadata``...) and the ``kwargs`` option as keyword arguments. It returns `n` numbers (a list or a
tensor `[n]`; NaN where a sample cannot be scored) or a whole [`~mmgrpo.types.RewardResult`].
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from .types import RewardResult
from .validation import ConfigError, check_fields


@dataclass
class FunctionRewardConfig:
    """Options of a reward given as a plain function.

    Args:
        modalities (`list[str]`): the output modalities the function reads (``image``, ``video``, ``text``...); the
            pipeline must produce them.
        kwargs (`dict`): keyword arguments passed to the function on every call.
    """

    modalities: list[str] = field(default_factory=list)
    kwargs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        check_fields(self)
        if not self.modalities:
            raise ConfigError("modalities: list the output modalities the reward function reads, e.g. "
                              "reward.modalities: [image] (or [text], [video]).")


def _result(values: Any, n: int, name: str) -> RewardResult:
    """A function's return value as a [`RewardResult`] of `n` samples."""
    if isinstance(values, RewardResult):
        return values
    try:
        scores = torch.as_tensor(values.detach() if isinstance(values, torch.Tensor) else values,
                                 dtype=torch.float32).cpu()  # [n]
    except (TypeError, ValueError, RuntimeError) as err:
        raise ValueError(f"reward function {name} returned {type(values).__name__}, not numbers ({err}).") from None
    if tuple(scores.shape) != (n,):
        raise ValueError(f"reward function {name} returned scores of shape {tuple(scores.shape)} for {n} samples: "
                         "return one number per sample.")
    return RewardResult(scores=scores)


@functools.cache
def function_reward(fn: Callable) -> type:
    """The reward class that calls `fn` ``(outputs, batch, **kwargs) -> scores`` (see the module docstring); the same
    class for the same function.

    Raises:
        `ValueError`: `fn` cannot be called with two positional arguments.
    """
    name = f"{fn.__module__}:{fn.__qualname__}"
    try:
        inspect.signature(fn).bind(None, None)
    except TypeError:
        raise ValueError(f"reward function {name} must take (outputs, batch) and return one score per "
                         "sample.") from None
    except ValueError:  # a builtin without a signature: called as is
        pass
    summary = (inspect.getdoc(fn) or "").split("\n\n")[0] or f"The reward function {name}."

    class FunctionReward:
        __doc__ = summary
        Config = FunctionRewardConfig
        group_stage = None  # each sample is scored alone
        artifacts = frozenset()

        @classmethod
        def modalities_for(cls, config: FunctionRewardConfig) -> frozenset[str]:
            return frozenset(config.modalities)

        @classmethod
        def artifacts_for(cls, config: FunctionRewardConfig) -> frozenset[str]:
            return frozenset()

        def __init__(self, config: FunctionRewardConfig | None = None):
            self.config = config or FunctionRewardConfig(modalities=["image"])
            self.modalities = self.modalities_for(self.config)

        def __call__(self, outputs: dict[str, Any], batch) -> RewardResult:
            return _result(fn(outputs, batch, **self.config.kwargs), len(batch), name)

    FunctionReward.__qualname__ = FunctionReward.__name__ = f"FunctionReward[{name}]"
    return FunctionReward
