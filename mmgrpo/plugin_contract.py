"""The declarations a plugin that is not built in (an installed entry point, a ``module:attribute`` spec) must make,
checked when it is loaded, so a missing or ill-typed one fails as a one-line config error before any model loads
rather than in the middle of a step. They are the class-level members of its contract in [`mmgrpo.protocols`]; what
preflight then reads of them (modalities, plan families and features, scoring, prompt items) it checks as for a
built-in plugin. A plain function given as a reward is wrapped first ([`mmgrpo.function_reward`]).
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
from typing import Any, Callable

FAMILIES = ("flow", "token", "masked")
SCORINGS = ("trajectory", "likelihood")


def _frozen_strings(value: Any) -> bool:
    return isinstance(value, frozenset) and all(isinstance(v, str) for v in value)


def _provides(value: Any) -> bool:
    return isinstance(value, dict) and bool(value) and set(value) <= {"log_prob", "likelihood"} and all(
        _frozen_strings(v) for v in value.values())


# kind -> the class-level declarations of its contract: name -> (check of the value, what it must be)
DECLARATIONS: dict[str, dict[str, tuple[Callable[[Any], bool], str]]] = {
    "pipeline": {
        "modalities": (lambda v: _frozen_strings(v) and bool(v), "a non-empty frozenset of output modalities"),
        "provides": (_provides, "a dict of scoring method ('log_prob', 'likelihood') -> frozenset of Score fields"),
        "plan_families": (lambda v: isinstance(v, tuple) and bool(v) and set(v) <= set(FAMILIES),
                          f"a non-empty tuple of plan families among {FAMILIES}"),
        "plan_features": (_frozen_strings, "a frozenset of plan features"),
        "capabilities": (_frozen_strings, "a frozenset of optional members (empty for none)"),
        **{method: (callable, "a method") for method in (
            "prepare", "sample", "log_prob", "reference", "trainable_parameters", "trainable_modules",
            "save_pretrained", "load_trainable", "export_pretrained")},
    },
    "algorithm": {
        "scoring": (lambda v: v in SCORINGS, f"one of {SCORINGS}"),
        "plan_family": (lambda v: v in FAMILIES, f"one of {FAMILIES}"),
        **{method: (callable, "a method") for method in ("schedule", "advantages", "loss")},
    },
    "reward": {
        "group_stage": (lambda v: v is None or callable(v), "None or a function (result, group_ids) -> result"),
        "modalities_for": (callable, "a classmethod (config) -> frozenset of modalities"),
        "artifacts_for": (callable, "a classmethod (config) -> frozenset of artifact kinds"),
        "__call__": (callable, "a method (outputs, batch) -> RewardResult"),
    },
    "data": {
        "disjoint_splits": (lambda v: isinstance(v, bool), "a bool"),
        **{method: (callable, "a method") for method in ("train_items", "eval_items", "eval_splits")},
    },
}


def load_spec(spec: str) -> Any:
    """The object that ``module:attribute`` `spec` names (the module is imported: the caller checked that user code
    is allowed).

    Raises:
        `ValueError`: the module cannot be imported (the message says why) or has no such attribute.
    """
    module_name, _, attribute = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"{spec!r}: module {module_name} could not be imported ({err}); install it or put its "
                         "folder on PYTHONPATH.") from None
    members = vars(module)  # a user's module: its top-level names
    if attribute not in members:
        raise ValueError(f"{spec!r}: module {module_name} has no top-level {attribute!r}.")
    return members[attribute]


def check_plugin(kind: str, plugin: Any, what: str) -> type:
    """`plugin` (a class; for a reward also a plain function, wrapped by [`~mmgrpo.function_reward.function_reward`])
    after checking that it declares what a `kind` plugin must (see [`DECLARATIONS`]) and a ``Config`` dataclass;
    `what` names it in errors.

    Raises:
        `ValueError`: naming the first missing or ill-typed declaration.
    """
    if kind == "reward" and inspect.isfunction(plugin):
        from .function_reward import function_reward

        return function_reward(plugin)
    if not inspect.isclass(plugin):
        allowed = "a class (or a function (outputs, batch) -> scores)" if kind == "reward" else "a class"
        raise ValueError(f"{what} is a {type(plugin).__name__}, not a {kind} plugin: it must be {allowed}.")
    config = inspect.getattr_static(plugin, "Config", None)  # a third-party class: read, never called
    if not (inspect.isclass(config) and dataclasses.is_dataclass(config)):
        raise ValueError(f"{what} ({plugin.__name__}) must declare `Config`, a dataclass of its options (see "
                         "mmgrpo.protocols).")
    for name, (valid, wanted) in DECLARATIONS[kind].items():
        value = inspect.getattr_static(plugin, name, inspect.Parameter.empty)
        if isinstance(value, (classmethod, staticmethod)):
            value = value.__func__
        if value is inspect.Parameter.empty:
            raise ValueError(f"{what} ({plugin.__name__}) does not declare {name!r}, which every {kind} declares: "
                             f"{wanted} (see mmgrpo.protocols).")
        if not valid(value):
            raise ValueError(f"{what} ({plugin.__name__}) declares {name} = {value!r}, but it must be {wanted}.")
    return plugin
