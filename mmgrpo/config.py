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
from typing import Any, Literal

from . import registry
from .config_yaml import parse_yaml, read_yaml
from .tracking import TrackingConfig
from .vas import VASConfig, check_sampling
from .validation import (  # noqa: F401 (ConfigError and build_dataclass are imported from here by callers)
    NULL_WORDS, ConfigError, build_dataclass, check_fields, check_range, check_seed, check_text, coerce, flat_dict,
    flat_hints, takes_none, takes_text,
)

STEPS_LIMIT = 10**9  # trainer steps (and the step counts of warm-up, evaluation, checkpoints, logging)
SECONDS_LIMIT = 10**8  # a time budget in seconds (three years)
SAMPLES_LIMIT = 2**20  # samples per step (prompts x group size), and held-out prompts per evaluation
# the sizes of one step: a refusal beyond these limits, which no real run reaches
SIZE_LIMITS = {"max_steps": STEPS_LIMIT, "prompts_per_step": 2**16, "group_size": 1024, "minibatch_size": 2**16,
               "updates_per_step": 1024, "inner_epochs": 1024}
SIZE_FIXES = {"prompts_per_step": "real runs use 8 to ~1024 prompts per step",
              "group_size": "real runs use 4 to ~64 samples per prompt",
              "minibatch_size": "samples per backward pass; gradients accumulate over minibatches"}


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
        prompt_sampling (`str`), vas (`VASConfig`): ``"uniform"`` (a seeded shuffle per epoch), ``"vas"`` (MMR1's
            variance-aware sampling from extra rollouts; options in `vas`, see [`mmgrpo.vas`]) or ``"group_variance"``
            (by the training groups' reward variance); see [`~mmgrpo.prompt_stream.PromptStream`]. Checkpointed.
        prompt_sampling_mix (`float`): MMR1's mixture ratio under ``"vas"`` (in [0, 1]), else the share by variance.
        max_grad_norm (`float`): gradient clipping.
        mixed_precision (`str`): ``"no"``, ``"bf16"`` or ``"fp16"`` (accelerate's autocast; under ``sharding:
            fsdp`` with several processes, ``bf16`` is FSDP2's mixed precision: bf16 compute, fp32 gradient reduction
            and fp32 sharded weights, and ``fp16`` is refused).
        sharding (`str`): how a multi-process run distributes the trained module: ``"ddp"`` (every process holds
            all of it), ``"fsdp"`` (FSDP2: parameters, gradients and optimizer state sharded per transformer block),
            ``"hybrid"`` (HSDP: sharded within each node, replicated across nodes; every node runs the same number of
            processes) or ``"none"`` (a single process; a multi-process launch is refused). One process is never
            sharded.
        group_placement (`str`): where a step's groups live. ``"spread"``: the batch is split over the processes in
            order and a group may span two of them; rewards are gathered, and the reward's group stage and the
            advantages run on the whole batch. ``"contiguous"``: every group lies on one process (``prompts_per_step``
            must be a multiple of the number of processes); they run on each process's own groups and only the final
            scores and advantages are gathered. Refused with advantages normalised over the whole batch.
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
    prompt_sampling: Literal["uniform", "group_variance", "vas"] = "uniform"
    prompt_sampling_mix: float = 0.5
    vas: VASConfig = field(default_factory=VASConfig)
    max_grad_norm: float = 1.0
    mixed_precision: Literal["no", "bf16", "fp16"] = "no"
    sharding: Literal["none", "ddp", "fsdp", "hybrid"] = "ddp"
    group_placement: Literal["spread", "contiguous"] = "spread"

    def __post_init__(self):
        check_fields(self)
        if self.sharding in ("fsdp", "hybrid") and self.mixed_precision == "fp16":
            raise ConfigError(f"train.mixed_precision: fp16 does not combine with train.sharding: {self.sharding} "
                              "(sharded fp16 needs a sharded loss scaler): use bf16 (bf16 compute, fp32 reductions) "
                              "or no.")
        values = vars(self)  # field name -> value
        for name, high in SIZE_LIMITS.items():
            check_range(f"train.{name}", values[name], 1, high, fix=SIZE_FIXES.get(name, ""))
        check_range("train.max_seconds", self.max_seconds, 0, SECONDS_LIMIT, fix="0: no time limit")
        if self.group_size < 2:
            raise ConfigError("train.group_size must be >= 2: group-relative advantages need at least two samples.")
        samples = self.prompts_per_step * self.group_size
        if samples > SAMPLES_LIMIT:
            raise ConfigError(f"train.prompts_per_step x train.group_size = {samples} samples per step, more than any "
                              f"real run ({SAMPLES_LIMIT}): lower train.prompts_per_step or train.group_size.")
        check_range("train.learning_rate", self.learning_rate, 0, 1.0, low_open=True,
                    fix="AdamW steps each weight by about the learning rate (RL runs use 1e-6 to 1e-3)")
        check_range("train.weight_decay", self.weight_decay, 0, 10.0, fix="1e-4 to 0.1 is usual")
        if self.learning_rate * self.weight_decay >= 1:
            raise ConfigError(f"train.weight_decay {self.weight_decay} x train.learning_rate {self.learning_rate} must "
                              "be < 1: AdamW multiplies each weight by 1 - lr x weight_decay every update, which would "
                              "zero or flip it; lower train.weight_decay.")
        if len(self.adam_betas) != 2:
            raise ConfigError(f"train.adam_betas must have two values, got {self.adam_betas}.")
        for i, beta in enumerate(self.adam_betas):
            check_range(f"train.adam_betas[{i}]", beta, 0, 1, high_open=True, fix="AdamW's betas are in [0, 1)")
        check_range("train.adam_eps", self.adam_eps, 1e-30, 1.0, fix="1e-8 is usual; smaller vanishes in float32 and "
                    "turns a zero gradient into 0 / 0")
        check_range("train.warmup_steps", self.warmup_steps, 0, STEPS_LIMIT, fix="0: no warm-up")
        check_range("train.min_lr_ratio", self.min_lr_ratio, 0, 1)
        check_sampling(self)  # train.prompt_sampling_mix, by sampling
        check_range("train.max_grad_norm", self.max_grad_norm, 0, 1e12, low_open=True,
                    fix="1.0 is usual; 1e6 clips nothing")


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
        check_fields(self)
        check_range("eval.every", self.every, 0, STEPS_LIMIT, fix="0 disables")
        check_range("eval.every_seconds", self.every_seconds, 0, SECONDS_LIMIT, fix="0 disables")
        check_range("eval.num_prompts", self.num_prompts, 1, SAMPLES_LIMIT)
        check_range("eval.grid_size", self.grid_size, 0, 1024, fix="0 draws no grid")
        check_seed("eval.seed", self.seed)
        if not self.metric.strip():
            raise ConfigError("eval.metric must name a reward component, or 'score' for the reward itself; got ''.")
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

    def __post_init__(self):
        check_fields(self)
        check_range("checkpoint.every", self.every, 0, STEPS_LIMIT, fix="0 saves only at the end")
        check_range("checkpoint.keep_last", self.keep_last, 1, 10**6, fix="the newest checkpoint is always kept")
        check_text("checkpoint.resume_from", self.resume_from)


@dataclass
class SFTConfig:
    """Supervised fine-tuning (``mmgrpo sft``; ``mmgrpo train`` ignores this section). The SFT run takes its sizes and
    optimizer from ``train`` (``max_steps``, ``prompts_per_step`` items per step, ``minibatch_size``, the learning
    rate and its schedule, clipping, precision; one optimizer update per step: ``group_size``, ``updates_per_step``
    and ``inner_epochs`` are RL-only). See [`mmgrpo.sft`].

    Args:
        target_key (`str`): the key of each item's metadata that holds its target completion (a JSONL row's
            ``"completion"`` field; ``vlm_shapes`` writes it with ``with_targets: true``).
        thought_dropout (`float`): TON's thought dropout: the probability that a target's ``<think>...</think>``
            content is replaced by an empty thought, drawn once per item from the run's seed.
        eval_reward (`bool`): at each held-out evaluation (``eval.every``), also sample the held-out prompts
            greedily and score them with the config's reward, as ``mmgrpo train`` evaluates (``eval/score``,
            ``eval/<component>``, per-prompt scores and samples); otherwise only the held-out target loss.
    """

    target_key: str = "completion"
    thought_dropout: float = 0.0
    eval_reward: bool = False

    def __post_init__(self):
        check_fields(self)
        check_text("sft.target_key", self.target_key)
        check_range("sft.thought_dropout", self.thought_dropout, 0, 1, fix="0 keeps every thought, 1 empties all")


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
                    "sft": self.sft}
        for name, section in sections.items():
            out[name] = dataclasses.asdict(section)
        return out


def check_resume(resume_from: str, output_dir: str) -> None:
    """Refuses a `checkpoint.resume_from` that names no complete checkpoint (``latest``: none under `output_dir`)."""
    from . import checkpoint  # torch: only when resuming

    try:
        checkpoint.resolve(resume_from, Path(output_dir) / "checkpoints")
    except (OSError, ValueError) as err:
        message = " ".join(str(err).split())
        raise ConfigError(message if message.startswith("checkpoint.resume_from") else
                          f"checkpoint.resume_from: {message}") from None


PLUGIN_KINDS = ("pipeline", "algorithm", "reward", "data")
SECTIONS = {"train": TrainConfig, "eval": EvalConfig, "checkpoint": CheckpointConfig, "tracking": TrackingConfig,
            "sft": SFTConfig}
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
        if not isinstance(name, str) or name not in registry.available(head):
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
        raise ConfigError(f"Unknown config key {unknown[0]}. Valid top-level keys: {', '.join(sorted(TOP_LEVEL))}.")
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
    )


def load(path: str | Path, overrides: list[str] = ()) -> ExperimentConfig:
    """Reads a YAML experiment file (see [`mmgrpo.config_yaml`]), applies overrides and validates everything."""
    return from_dict(apply_overrides(read_yaml(path), list(overrides)))
