"""Experiment configuration: YAML plus ``key=value`` overrides, checked strictly against dataclasses before any
model loads. Unknown keys, wrong types, non-finite numbers and out-of-range values are errors that name the key and
say what was expected.

YAML is read with the YAML 1.2 core scalars (see [`mmgrpo.config_yaml`]: ``no`` / ``on`` are strings, ``3e-4`` is a
float, duplicate keys are errors). An override ``a.b.c=value`` gives a field that takes strings (``str``, a choice of
strings, or an optional string) the text exactly as typed, so ``train.mixed_precision=no`` and
``data.template=3`` are strings; ``null`` or ``~`` give None where the field is optional; a quoted value
(``'...'`` / ``"..."``) is read as YAML. Any other field reads the value as YAML (numbers, ``true`` / ``false``,
lists ``[a, b]``, mappings ``{a: 1}``).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import peer_names, registry
from .config_yaml import parse_yaml, read_yaml
from .sections import STEPS_LIMIT, CheckpointConfig, EvalConfig, RolloutConfig, SFTConfig, TrainConfig
from .tracking import TrackingConfig
from .validation import (  # noqa: F401 (ConfigError and build_dataclass are imported from here by callers)
    NULL_WORDS, ConfigError, build_dataclass, check_fields, check_range, check_seed, check_text, coerce, flat_dict,
    flat_hints, takes_none, takes_text,
)


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
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)

    def __post_init__(self):
        check_fields(self)
        check_text("output_dir", self.output_dir)
        check_seed("seed", self.seed)
        check_range("log_every", self.log_every, 1, STEPS_LIMIT, fix="1 logs every step")
        if self.checkpoint.resume_from:
            check_resume(self.checkpoint.resume_from, self.output_dir)

    def to_dict(self) -> dict:
        out = {"output_dir": self.output_dir, "seed": self.seed, "log_every": self.log_every}
        plugins = {"pipeline": self.pipeline, "algorithm": self.algorithm, "reward": self.reward, "data": self.data}
        for kind, spec in plugins.items():
            out[kind] = {"name": spec.name, **flat_dict(spec.options)}  # embedded records written flat
        sections = {"train": self.train, "eval": self.eval, "checkpoint": self.checkpoint, "tracking": self.tracking,
                    "sft": self.sft, "rollout": self.rollout}
        for name, section in sections.items():
            out[name] = flat_dict(section)  # each field under its key (train.async)
        return out


def check_resume(resume_from: str, output_dir: str) -> None:
    """Refuses a `checkpoint.resume_from` that names no complete checkpoint (``latest``: none under `output_dir`)."""
    from . import checkpoint  # torch: only when resuming

    if resume_from == "auto":  # the latest complete checkpoint if any, else a fresh start: nothing to refuse
        return
    try:
        checkpoint.resolve(resume_from, Path(output_dir) / "checkpoints")
    except (OSError, ValueError) as err:
        message = " ".join(str(err).split())
        raise ConfigError(message if message.startswith("checkpoint.resume_from") else
                          f"checkpoint.resume_from: {message}") from None


PLUGIN_KINDS = ("pipeline", "algorithm", "reward", "data")
SECTIONS = {"train": TrainConfig, "eval": EvalConfig, "checkpoint": CheckpointConfig, "tracking": TrackingConfig,
            "sft": SFTConfig, "rollout": RolloutConfig}
TOP_TYPES = {"output_dir": str, "seed": int, "log_every": int}
TOP_LEVEL = set(TOP_TYPES) | set(PLUGIN_KINDS) | set(SECTIONS)


def plugin_spec(kind: str, raw: Any) -> PluginSpec:
    """The registry entry and checked options of one plugin section ``{name: ..., **options}``."""
    choices = ", ".join(sorted(registry.available(kind)))
    if not isinstance(raw, dict) or "name" not in raw:
        raise ConfigError(f"{kind}: expected a mapping with a 'name' key (one of: {choices}), got {raw!r}.")
    options = dict(raw)
    name = options.pop("name")
    if not isinstance(name, str):
        raise ConfigError(f"{kind}.name: expected one registered name (one of: {choices}), got {name!r} "
                          f"({type(name).__name__}).")
    try:
        plugin = registry.get(kind, name)
    except ValueError as err:
        raise ConfigError(f"{kind}.name: {err}") from err
    return PluginSpec(name=name, options=build_dataclass(plugin.Config, options, kind))


def field_type(raw: dict, parts: list[str]) -> Any:
    """The annotation of the config field at key path `parts` in experiment mapping `raw`, or None when unknown (an
    unknown key, a plugin not named yet, a free-form mapping)."""
    head = parts[0]
    if len(parts) == 1:
        return TOP_TYPES.get(head)
    if head in SECTIONS:
        tp = SECTIONS[head]
    elif head in PLUGIN_KINDS:
        if parts[1:] == ["name"]:
            return str
        name = raw.get(head, {}).get("name") if isinstance(raw.get(head), dict) else None
        if not isinstance(name, str) or not registry.resolvable(head, name):
            return None
        tp = registry.get(head, name).Config
    else:
        return None
    for part in parts[1:]:
        hints = flat_hints(tp) if dataclasses.is_dataclass(tp) else {}  # with embedded records' keys
        if part not in hints:
            return None
        tp = hints[part]
    return tp


def parse_override(text: str, tp: Any, key: str) -> Any:
    """The value of override ``key=text`` for a field annotated `tp` (None: unknown); see the module docstring."""
    stripped = text.strip()
    if tp is not None and takes_text(tp) and not stripped.startswith(("'", '"')):
        return None if takes_none(tp) and stripped in NULL_WORDS else text
    return parse_yaml(text, f"override {key}")


_KEY_PART = re.compile(r"^[A-Za-z_][\w-]*$")


def apply_overrides(raw: dict, overrides: list[str]) -> dict:
    """Applies ``a.b.c=value`` overrides to experiment mapping `raw`, in place (values as the module docstring says;
    plugin names first, so an option is read with its plugin's types)."""
    if not overrides:
        return raw
    if not isinstance(raw, dict):
        raise ConfigError(f"A config must be a mapping at top level, got {type(raw).__name__}; overrides need one.")
    names_first = sorted(overrides, key=lambda item: item.split("=", 1)[0].strip() not in
                         {f"{kind}.name" for kind in PLUGIN_KINDS})
    for item in names_first:
        key, sep, text = item.partition("=")
        parts = key.strip().split(".")
        if not sep or not all(_KEY_PART.match(part) for part in parts):
            raise ConfigError(f"Override {item!r} must look like key.subkey=value (e.g. train.learning_rate=1e-4).")
        node = raw
        for depth, part in enumerate(parts[:-1]):
            if node.get(part) is None:
                node[part] = {}
            node = node[part]
            if not isinstance(node, dict):
                where = ".".join(parts[: depth + 1])
                raise ConfigError(f"Override {item!r}: {where} is {node!r}, not a mapping of options; set {where}= "
                                  "itself or a key that exists below a mapping.")
        node[parts[-1]] = parse_override(text, field_type(raw, parts), ".".join(parts))
    return raw


def from_dict(raw: dict) -> ExperimentConfig:
    """Validates a whole experiment mapping (plugins included); raises [`ConfigError`] naming the bad key."""
    if not isinstance(raw, dict):
        raise ConfigError(f"A config must be a mapping at top level, got {type(raw).__name__}.")
    unknown = sorted(set(raw) - TOP_LEVEL, key=str)
    if unknown:
        raise ConfigError(f"Unknown config key {unknown[0]}.{peer_names.hint(str(unknown[0]))} Valid top-level keys: "
                          f"{', '.join(sorted(TOP_LEVEL))}.")
    for required in ("output_dir", "pipeline", "algorithm", "reward", "data"):
        if required not in raw:
            raise ConfigError(f"Missing required config key {required}.")
    return ExperimentConfig(
        output_dir=coerce(raw["output_dir"], str, "output_dir"),
        seed=coerce(raw.get("seed", 0), int, "seed"),
        log_every=coerce(raw.get("log_every", 1), int, "log_every"),
        pipeline=plugin_spec("pipeline", raw["pipeline"]),
        algorithm=plugin_spec("algorithm", raw["algorithm"]),
        reward=plugin_spec("reward", raw["reward"]),
        data=plugin_spec("data", raw["data"]),
        train=build_dataclass(TrainConfig, raw.get("train"), "train"),
        eval=build_dataclass(EvalConfig, raw.get("eval"), "eval"),
        checkpoint=build_dataclass(CheckpointConfig, raw.get("checkpoint"), "checkpoint"),
        tracking=build_dataclass(TrackingConfig, raw.get("tracking"), "tracking"),
        sft=build_dataclass(SFTConfig, raw.get("sft"), "sft"),
        rollout=build_dataclass(RolloutConfig, raw.get("rollout"), "rollout"),
    )


def load(path: str | Path, overrides: list[str] = ()) -> ExperimentConfig:
    """Reads a YAML experiment file (see [`mmgrpo.config_yaml`]), applies overrides and validates everything."""
    return from_dict(apply_overrides(read_yaml(path), list(overrides)))
