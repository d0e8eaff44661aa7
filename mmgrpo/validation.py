"""Checks shared by every configuration dataclass: values against their annotations (types, finite numbers), ranges,
seeds, and the building of a dataclass from a mapping. Errors are [`ConfigError`]s that start with the key.

A plugin's ``Config.__post_init__`` calls [`check_fields`] first (types, finiteness and the shared ceiling of every
field, so the checks after it compare numbers with numbers), then [`check_range`] for each bound::

    def __post_init__(self):
        check_fields(self)
        check_range("clip_low", self.clip_low, low=0, low_open=True)

Every number a config holds has a ceiling: [`coerce`] refuses an integer beyond ``INT_LIMIT`` (2**40) and a float
beyond ``FLOAT_LIMIT`` (1e15) in magnitude, whatever the field, so no absurd size, step count or scale reaches a
model. A field with a tighter real limit (a learning rate, a resolution, a token count) states it with
[`check_range`]'s `high`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
import types
import typing
from typing import Any, Literal

from . import peer_names

# PyYAML (YAML 1.1) reads "3e-4" (no dot) as a string; a float field accepts it
_FLOAT_TEXT = re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$")
INT_LIMIT = 2**40  # no integer option of a real run (a size, a count, a step, a seed, a token id) is larger
FLOAT_LIMIT = 1e15  # nor is any float option (a rate, a weight, a scale, seconds) larger in magnitude
SEED_LIMIT = 2**32  # accelerate's set_seed seeds numpy's RandomState, which takes 0 <= seed < 2**32
NULL_WORDS = ("null", "Null", "NULL", "~")
# option names that were renamed so that one concept has one name in every plugin: old key -> the key(s) to use
RENAMED = {
    "clip_range": "clip_low (and clip_high)",
    "clip_range_high": "clip_high",
    "kl_coeff": "kl_beta",
    "global_std": "scale_rewards: batch (global_std: true) or group (false)",
    "filter_groups": "token_mean: update_with_signal (filter_groups: true) or rollout (TRL's count)",
}
# options whose value type changed: key -> (old type, the message's fix)
RETYPED = {"scale_rewards": (bool, "give 'group' for true (divide by the group's std) or 'none' for false")}
# option values that were renamed or split: (key, old value) -> the value(s) to use
RENAMED_VALUES = {("prompt_sampling", "variance"): "'group_variance' (the former rule: the training groups' reward "
                                                   "variance) or 'vas' (MMR1's variance-aware sampling)",
                  ("solver", "euler"): "'flow' (FlowPlan.solver's word for the pipeline's own Euler ODE)"}


class ConfigError(ValueError):
    """A configuration problem, reported before anything heavy happens."""


def type_name(tp: Any) -> str:
    """A readable name of annotation `tp` (``int``, ``list[str]``, ``Literal['a', 'b']``)."""
    return getattr(tp, "__name__", None) if not typing.get_args(tp) else str(tp).replace("typing.", "")


def takes_text(tp: Any) -> bool:
    """Whether annotation `tp` accepts a string (``str``, a ``Literal`` of strings, or a union holding one): such a
    field takes a command-line override's text as written (``no`` stays ``"no"``, ``3`` stays ``"3"``)."""
    if tp is str:
        return True
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        return all(isinstance(a, str) for a in args)
    if origin in (typing.Union, types.UnionType):
        return any(takes_text(a) for a in args)
    return False


def takes_none(tp: Any) -> bool:
    """Whether annotation `tp` is optional (a union with ``None``)."""
    return typing.get_origin(tp) in (typing.Union, types.UnionType) and type(None) in typing.get_args(tp)


def _union(value: Any, args: tuple, key: str) -> Any:
    if value is None and type(None) in args:
        return None
    records = [arg for arg in args if dataclasses.is_dataclass(arg)]
    if isinstance(value, dict) and len(records) == 1:  # an optional section given: its own errors name the key
        return coerce(value, records[0], key)
    for arg in args:
        if arg is type(None):
            continue
        try:
            return coerce(value, arg, key)
        except ConfigError:
            continue
    names = " or ".join("null" if a is type(None) else type_name(a) for a in args)
    raise ConfigError(f"{key}: expected {names}, got {value!r} ({type(value).__name__}).")


def _number(value: Any, key: str) -> float:
    if isinstance(value, str) and _FLOAT_TEXT.match(value.strip()):
        value = float(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{key}: expected a number, got {value!r} ({type(value).__name__}).")
    try:
        value = float(value)
    except OverflowError:
        raise ConfigError(f"{key}: {value} is too large for a float; give a finite number.") from None
    if not math.isfinite(value):
        raise ConfigError(f"{key}: must be a finite number, got {value}; NaN and infinities are not usable values.")
    if abs(value) > FLOAT_LIMIT:
        raise ConfigError(f"{key} must be within +-{FLOAT_LIMIT:g}, got {value!r}; no real run uses a value this "
                          "large.")
    return value


def _integer(value: Any, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{key}: expected an integer, got {value!r} ({type(value).__name__}).")
    if abs(value) > INT_LIMIT:
        raise ConfigError(f"{key} must be within +-2**40 ({INT_LIMIT}), got {value}; no real run uses a value this "
                          "large.")
    return value


def coerce(value: Any, tp: Any, key: str) -> Any:
    """Checks `value` against annotation `tp` and returns it converted (ints are accepted for floats, lists for
    tuples; floats must be finite; numbers within ``INT_LIMIT`` / ``FLOAT_LIMIT``, also inside lists and mappings);
    raises [`ConfigError`] naming `key`."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        return _union(value, args, key)
    if origin is Literal:
        if not any(value == a and type(value) is type(a) for a in args):
            choices = [repr(a) for a in args]
            wanted = " or ".join(choices) if len(choices) < 3 else f"{', '.join(choices[:-1])} or {choices[-1]}"
            raise ConfigError(f"{key} must be {wanted}, got {value!r}.")
        return value
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list, got {value!r} ({type(value).__name__}).")
        inner = args[0] if args else Any
        return [coerce(v, inner, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {value!r} ({type(value).__name__}).")
        inner = args[1] if len(args) == 2 else Any
        return {k: coerce(v, inner, f"{key}.{k}") for k, v in value.items()}
    if dataclasses.is_dataclass(tp):
        return value if isinstance(value, tp) else build_dataclass(tp, value, key)
    if tp is float:
        return _number(value, key)
    if tp is int:
        return _integer(value, key)
    if tp in (str, bool):
        if not isinstance(value, tp):
            hint = " (quote it in YAML: '...')" if tp is str and isinstance(value, (int, float, bool)) else ""
            raise ConfigError(f"{key}: expected {tp.__name__}, got {value!r} ({type(value).__name__}){hint}.")
        return value
    return value


def check_fields(config: Any) -> None:
    """Checks (and converts, see [`coerce`]) every field of dataclass instance `config` against its annotation; the
    first thing a ``Config.__post_init__`` does. Errors name the field."""
    hints, values = typing.get_type_hints(type(config)), vars(config)  # field name -> annotation, value
    for f in dataclasses.fields(config):
        if f.init:
            setattr(config, f.name, coerce(values[f.name], hints[f.name], f.name))


def check_range(key: str, value: float, low: float | None = None, high: float | None = None, *,
                low_open: bool = False, high_open: bool = False, fix: str = "") -> None:
    """Raises [`ConfigError`] unless ``low <= value <= high`` (``<`` where `low_open` / `high_open`; a bound of None
    is no bound). The message starts with `key`, states the bound crossed (then the other one), and ends with `fix`
    when given: ``lora_rank must be <= 4096 (and >= 0), got 9000; ...``."""
    too_low = low is not None and (value <= low if low_open else value < low)
    too_high = high is not None and (value >= high if high_open else value > high)
    if not (too_low or too_high):
        return
    above = f"{'>' if low_open else '>='} {low}" if low is not None else None
    below = f"{'<' if high_open else '<='} {high}" if high is not None else None
    crossed, other = (above, below) if too_low else (below, above)
    wanted = crossed + (f" (and {other})" if other else "")
    raise ConfigError(f"{key} must be {wanted}, got {value!r}" + (f"; {fix}" if fix else "") + ".")


def check_seed(key: str, value: int) -> None:
    """A seed every RNG of a run accepts: ``0 <= seed < 2**32`` (numpy's limit; Python's and torch's are wider)."""
    check_range(key, value, 0, SEED_LIMIT, high_open=True, fix="numpy's RandomState takes seeds below 2**32")


def check_text(key: str, value: str | None) -> None:
    """Refuses an empty or blank string (a name, a path) where one is required."""
    if value is not None and not value.strip():
        raise ConfigError(f"{key} must not be empty; give a value or leave the key out for its default.")


def check_template(key: str, template: str, **fields: Any) -> None:
    """Refuses a ``str.format`` template that fails with exactly `fields` (another field name, a stray brace)."""
    try:
        template.format(**fields)
    except (KeyError, IndexError, ValueError) as err:
        names = ", ".join("{" + name + "}" for name in fields)
        raise ConfigError(f"{key} {template!r} may use only the fields {names} (double other braces: '{{{{'): "
                          f"{type(err).__name__} {err}.") from None


def _prefixed(message: str, prefix: str, fields: typing.Iterable[str]) -> str:
    """`message` starting with ``prefix.`` (when it starts with one of `fields`) or ``prefix: ``."""
    if message.startswith((f"{prefix}.", f"{prefix}:", f"{prefix} ")):
        return message
    head = re.split(r"[\s:\[=]", message, maxsplit=1)[0]
    return f"{prefix}.{message}" if head in fields else f"{prefix}: {message}"


def check_renamed(values: dict, fields: typing.Iterable[str], prefix: str) -> None:
    """Refuses a key of `values` that [`RENAMED`] lists (and `fields` lacks), an old value [`RENAMED_VALUES`] lists or
    an old-typed value [`RETYPED`] lists, with a one-line message naming the key or value to use."""
    for key, value in values.items():
        if key in RENAMED and key not in fields and re.split(r"[\s:]", RENAMED[key])[0] in fields:  # else: another section's
            new = RENAMED[key].replace("and ", f"and {prefix}.")
            raise ConfigError(f"{prefix}.{key} was renamed: use {prefix}.{new}.")
        if isinstance(value, str) and (key, value) in RENAMED_VALUES:
            raise ConfigError(f"{prefix}.{key}: {value!r} was renamed: use {RENAMED_VALUES[key, value]}.")
        if key in RETYPED and key in fields and isinstance(value, RETYPED[key][0]):
            raise ConfigError(f"{prefix}.{key} is no longer a {RETYPED[key][0].__name__}: {RETYPED[key][1]}.")


EMBEDDED = "mmgrpo.embedded"  # dataclass field metadata key of an embedded record (see `embedded`)
KEY = "mmgrpo.key"  # dataclass field metadata: the option's key where the field's name cannot be it (a Python keyword)


def option_key(field: dataclasses.Field) -> str:
    """The key of dataclass `field` in a config mapping: its name, or the key its metadata gives where the name cannot
    be one (``train.async`` is the field ``async_``: ``async`` is a Python keyword)."""
    return field.metadata.get(KEY, field.name)


def embedded(record: type, **defaults: Any) -> Any:
    """A Config field holding an options `record` (a dataclass such as
    [`~mmgrpo.algorithms._options.AdvantageOptions`]) whose fields are written flat beside the Config's own: YAML says
    ``scale_rewards: group``, not ``advantage: {scale_rewards: group}``. `defaults` are this Config's own defaults of
    the record's fields (an algorithm keeps its authors' values); a mapping that sets some of the record's keys starts
    from them ([`build_dataclass`]), and [`flat_dict`] writes the record's fields back flat."""
    return dataclasses.field(default_factory=functools.partial(record, **defaults), metadata={EMBEDDED: True})


def is_embedded(field: dataclasses.Field) -> bool:
    """Whether dataclass `field` holds an embedded record (see [`embedded`])."""
    return bool(field.metadata.get(EMBEDDED))


def flat_hints(cls: type) -> dict[str, Any]:
    """The annotation of every key a mapping of dataclass `cls` may hold: its own init fields and the fields of its
    embedded records (see [`embedded`]). Raises `TypeError` when two of them share a name."""
    hints = typing.get_type_hints(cls)
    flat: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        inner = typing.get_type_hints(hints[f.name]) if is_embedded(f) else {option_key(f): hints[f.name]}
        names = [g.name for g in dataclasses.fields(hints[f.name]) if g.init] if is_embedded(f) else [option_key(f)]
        for name in names:
            if name in flat:
                raise TypeError(f"{cls.__name__}: option {name!r} is declared twice (embedded records share a flat "
                                "mapping: give each option one name).")
            flat[name] = inner[name]
    return flat


def flat_dict(config: Any) -> dict:
    """``dataclasses.asdict(config)`` with each embedded record's fields in place of the record (see [`embedded`]) and
    each field under its key ([`option_key`]): the flat mapping [`build_dataclass`] reads back."""
    whole, out = dataclasses.asdict(config), {}
    for f in dataclasses.fields(config):
        out.update(whole[f.name] if is_embedded(f) else {option_key(f): whole[f.name]})
    return out


def _record_error(err: Exception, prefix: str, fields: typing.Iterable[str]) -> ConfigError:
    return ConfigError(_prefixed(" ".join(str(err).split()), prefix, fields))


def build_dataclass(cls: type, values: dict | None, prefix: str) -> Any:
    """Builds dataclass `cls` from a mapping, rejecting unknown keys and wrong types, naming `prefix.key`.

    An embedded record's keys (see [`embedded`]) are read from the same flat mapping; the record starts from the
    field's default, so keys the mapping leaves out keep the Config's own defaults."""
    values = {} if values is None else values
    if not isinstance(values, dict):
        raise ConfigError(f"{prefix}: expected a mapping of options, got {values!r} ({type(values).__name__}).")
    flat = flat_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    check_renamed(values, flat, prefix)
    unknown = sorted(set(values) - set(flat), key=str)
    if unknown:
        raise ConfigError(
            f"Unknown config key {prefix}.{unknown[0]}" + (f" (and {unknown[1:]})" if len(unknown) > 1 else "")
            + f".{peer_names.hint(str(unknown[0]))} Valid keys of {prefix}: {', '.join(sorted(flat))}."
        )
    given = {name: coerce(value, flat[name], f"{prefix}.{name}") for name, value in values.items()}
    kwargs = {name: given[option_key(f)] for name, f in fields.items() if option_key(f) in given}
    for name, f in fields.items():
        if is_embedded(f):
            record = f.default_factory()
            keys = {g.name for g in dataclasses.fields(record) if g.init} & set(given)
            try:
                kwargs[name] = dataclasses.replace(record, **{key: given[key] for key in keys})
            except (ValueError, TypeError, OverflowError) as err:
                raise _record_error(err, prefix, flat) from err
    missing = [
        n for n, f in fields.items()
        if n not in kwargs and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        raise ConfigError(f"Missing required config key {prefix}.{missing[0]}.")
    try:
        return cls(**kwargs)
    except (ValueError, TypeError, OverflowError) as err:
        raise _record_error(err, prefix, flat) from err
