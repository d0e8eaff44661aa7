"""Experiment configuration: YAML plus ``key=value`` overrides, checked strictly against dataclasses before any
model loads. Unknown keys and wrong types are errors that name the key and say what was expected."""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from . import registry


_YAML_FLOAT = re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$")


class ConfigError(ValueError):
    """A configuration problem, reported before anything heavy happens."""


@dataclass
class TrainConfig:
    """Optimisation and rollout sizes.

    Args:
        max_steps (`int`): number of trainer steps (one rollout batch and its updates each).
        max_seconds (`float`): wall-clock training budget in seconds; 0 (the default) sets none. Only the time spent
            in training steps (rollout, reward, updates; logged as ``time/step_s``, cumulated as ``time/train_s``)
            counts: start-up, evaluation and checkpointing do not. The run stops after the step during which the
            total passed the budget (or at `max_steps`, whichever comes first), then evaluates and saves as after
            the last step. The total is kept in checkpoints, so a resumed run continues the same budget.
        prompts_per_step (`int`): distinct prompts sampled per step, over all processes (`B`).
        group_size (`int`): samples per prompt (`G`); `B * G` must divide evenly across processes.
        minibatch_size (`int`): samples per backward pass; gradients accumulate over minibatches.
        updates_per_step (`int`): optimizer updates per rollout batch (minibatches are split between them).
        inner_epochs (`int`): passes over each rollout batch.
        learning_rate (`float`), weight_decay (`float`), adam_betas (`list[float]`), adam_eps (`float`): AdamW.
        warmup_steps (`int`): linear learning-rate warm-up, in optimizer updates.
        lr_schedule (`str`): after warm-up, ``"constant"`` or ``"cosine"`` (decays to ``min_lr_ratio`` times the
            learning rate at the last update; group-relative RL on small models tends to gain fast and then
            oscillate, and a decay keeps what was gained).
        min_lr_ratio (`float`): final learning rate of the cosine schedule, as a fraction of `learning_rate`.
        max_grad_norm (`float`): gradient clipping.
        mixed_precision (`str`): ``"no"``, ``"bf16"`` or ``"fp16"`` (accelerate).
    """

    max_steps: int = 100
    max_seconds: float = 0.0
    prompts_per_step: int = 8
    group_size: int = 8
    minibatch_size: int = 8
    updates_per_step: int = 1
    inner_epochs: int = 1
    learning_rate: float = 3e-4
    weight_decay: float = 1e-4
    adam_betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    adam_eps: float = 1e-8
    warmup_steps: int = 0
    lr_schedule: Literal["constant", "cosine"] = "constant"
    min_lr_ratio: float = 0.1
    max_grad_norm: float = 1.0
    mixed_precision: Literal["no", "bf16", "fp16"] = "no"

    def __post_init__(self):
        for name in ("max_steps", "prompts_per_step", "group_size", "minibatch_size", "updates_per_step", "inner_epochs"):
            if getattr(self, name) < 1:
                raise ConfigError(f"train.{name} must be >= 1, got {getattr(self, name)}.")
        if self.max_seconds < 0:
            raise ConfigError(f"train.max_seconds must be >= 0 (0: no time limit), got {self.max_seconds}.")
        if self.group_size < 2:
            raise ConfigError("train.group_size must be >= 2: group-relative advantages need at least two samples.")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ConfigError(f"train.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}.")
        if len(self.adam_betas) != 2:
            raise ConfigError(f"train.adam_betas must have two values, got {self.adam_betas}.")


@dataclass
class EvalConfig:
    """Held-out evaluation.

    Args:
        every (`int`): evaluate every this many steps (and before the first and after the last step); 0 disables.
        every_seconds (`float`): also evaluate each time the training time (as counted by ``train.max_seconds``:
            training steps only) passes a multiple of this many seconds; 0 (the default) disables. For curves over
            wall-clock time, when the number of steps a budget allows is not known in advance. Evaluation happens
            before the first and after the last step when either `every` or `every_seconds` is set.
        num_prompts (`int`): held-out prompts evaluated (one deterministic sample each).
        grid_size (`int`): samples drawn in each `samples/step_*.png` grid.
        metric (`str`): the reward component reported as the headline eval metric (e.g. ``strict``), or
            ``score`` for the reward itself; not ``prompt``, ``n`` or ``reward``, the other columns of
            ``eval/step_*.json``.
        seed (`int`): noise seed of evaluation samples (the same every evaluation).
    """

    every: int = 10
    every_seconds: float = 0.0
    num_prompts: int = 64
    grid_size: int = 16
    metric: str = "score"
    seed: int = 1234

    def __post_init__(self):
        if self.every < 0 or self.every_seconds < 0:
            raise ConfigError(
                f"eval.every and eval.every_seconds must be >= 0 (0 disables), got {self.every} and {self.every_seconds}."
            )
        if self.metric in ("prompt", "n", "reward"):  # the other columns of eval/step_*.json
            raise ConfigError(
                f"eval.metric {self.metric!r} is a column name of eval/step_*.json: name a reward component, or "
                f"'score' for the reward itself."
            )


@dataclass
class CheckpointConfig:
    """Atomic checkpoints.

    Args:
        every (`int`): save every this many steps (0: only at the end).
        keep_last (`int`): complete checkpoints kept.
        resume_from (`str`, *optional*): ``"latest"`` (in this output_dir) or a checkpoint folder.
    """

    every: int = 0
    keep_last: int = 2
    resume_from: str | None = None


@dataclass
class PluginSpec:
    """A registry entry and its raw options (checked against the plugin's own Config)."""

    name: str
    options: Any  # the plugin's Config instance


@dataclass
class ExperimentConfig:
    """A whole experiment: one pipeline, one algorithm, one reward, one prompt source, plus trainer settings."""

    output_dir: str
    seed: int
    pipeline: PluginSpec
    algorithm: PluginSpec
    reward: PluginSpec
    data: PluginSpec
    train: TrainConfig
    eval: EvalConfig
    checkpoint: CheckpointConfig
    log_every: int = 1

    def to_dict(self) -> dict:
        out = {"output_dir": self.output_dir, "seed": self.seed, "log_every": self.log_every}
        for kind in ("pipeline", "algorithm", "reward", "data"):
            spec = getattr(self, kind)
            out[kind] = {"name": spec.name, **dataclasses.asdict(spec.options)}
        for name in ("train", "eval", "checkpoint"):
            out[name] = dataclasses.asdict(getattr(self, name))
        return out


def _type_name(tp) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Checks `value` against annotation `tp` (ints are accepted for floats); returns the converted value."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, key)
            except ConfigError as err:
                errors.append(str(err))
        raise ConfigError(f"{key}: expected {' or '.join(_type_name(a) for a in args)}, got {value!r}.")
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{key}: expected one of {list(args)}, got {value!r}.")
        return value
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list, got {value!r}.")
        inner = args[0] if args else Any
        return [_coerce(v, inner, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {value!r}.")
        return dict(value)
    if dataclasses.is_dataclass(tp):
        return build_dataclass(tp, value, key)
    if tp is float:
        if isinstance(value, str) and _YAML_FLOAT.match(value.strip()):
            return float(value)  # PyYAML reads "3e-4" (no dot) as a string
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}: expected a number, got {value!r} ({type(value).__name__}).")
        return float(value)
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: expected an integer, got {value!r} ({type(value).__name__}).")
        return value
    if tp in (str, bool):
        if not isinstance(value, tp):
            raise ConfigError(f"{key}: expected {tp.__name__}, got {value!r} ({type(value).__name__}).")
        return value
    return value


def build_dataclass(cls: type, values: dict | None, prefix: str) -> Any:
    """Builds dataclass `cls` from a mapping, rejecting unknown keys and wrong types, naming `prefix.key`."""
    values = {} if values is None else values
    if not isinstance(values, dict):
        raise ConfigError(f"{prefix}: expected a mapping of options, got {values!r}.")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(values) - set(fields))
    if unknown:
        raise ConfigError(
            f"Unknown config key {prefix}.{unknown[0]}" + (f" (and {unknown[1:]})" if len(unknown) > 1 else "")
            + f". Valid keys of {prefix}: {', '.join(sorted(fields))}."
        )
    kwargs = {name: _coerce(value, hints[name], f"{prefix}.{name}") for name, value in values.items()}
    missing = [
        n for n, f in fields.items()
        if n not in kwargs and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        raise ConfigError(f"Missing required config key {prefix}.{missing[0]}.")
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (ValueError, TypeError) as err:
        message = str(err)
        raise ConfigError(message if message.startswith(f"{prefix}.") else f"{prefix}: {message}") from err


def _plugin(kind: str, raw: Any) -> PluginSpec:
    if not isinstance(raw, dict) or "name" not in raw:
        choices = ", ".join(sorted(registry.available(kind)))
        raise ConfigError(f"{kind}: expected a mapping with a 'name' key (one of: {choices}), got {raw!r}.")
    options = dict(raw)
    name = options.pop("name")
    try:
        plugin = registry.get(kind, name)
    except ValueError as err:
        raise ConfigError(f"{kind}.name: {err}") from err
    return PluginSpec(name=name, options=build_dataclass(plugin.Config, options, kind))


def apply_overrides(raw: dict, overrides: list[str]) -> dict:
    """Applies ``a.b.c=value`` overrides (values parsed as YAML) to a nested mapping, in place."""
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"Override {item!r} must look like key.subkey=value.")
        key, text = item.split("=", 1)
        node = raw
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"Override {item!r}: {part} is not a mapping.")
        node[parts[-1]] = yaml.safe_load(text)
    return raw


TOP_LEVEL = {"output_dir", "seed", "log_every", "pipeline", "algorithm", "reward", "data", "train", "eval", "checkpoint"}


def from_dict(raw: dict) -> ExperimentConfig:
    """Validates a whole experiment mapping (plugins included); raises [`ConfigError`] naming the bad key."""
    if not isinstance(raw, dict):
        raise ConfigError(f"A config must be a mapping at top level, got {type(raw).__name__}.")
    unknown = sorted(set(raw) - TOP_LEVEL)
    if unknown:
        raise ConfigError(f"Unknown config key {unknown[0]}. Valid top-level keys: {', '.join(sorted(TOP_LEVEL))}.")
    for required in ("output_dir", "pipeline", "algorithm", "reward", "data"):
        if required not in raw:
            raise ConfigError(f"Missing required config key {required}.")
    return ExperimentConfig(
        output_dir=_coerce(raw["output_dir"], str, "output_dir"),
        seed=_coerce(raw.get("seed", 0), int, "seed"),
        log_every=_coerce(raw.get("log_every", 1), int, "log_every"),
        pipeline=_plugin("pipeline", raw["pipeline"]),
        algorithm=_plugin("algorithm", raw["algorithm"]),
        reward=_plugin("reward", raw["reward"]),
        data=_plugin("data", raw["data"]),
        train=build_dataclass(TrainConfig, raw.get("train"), "train"),
        eval=build_dataclass(EvalConfig, raw.get("eval"), "eval"),
        checkpoint=build_dataclass(CheckpointConfig, raw.get("checkpoint"), "checkpoint"),
    )


def load(path: str | Path, overrides: list[str] = ()) -> ExperimentConfig:
    """Reads a YAML experiment file, applies overrides and validates everything."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"Config file {path} does not exist.")
    raw = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    return from_dict(apply_overrides(raw, list(overrides)))
