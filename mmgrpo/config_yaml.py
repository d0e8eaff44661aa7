"""Reading configuration YAML: strict (duplicate keys are errors) and with YAML 1.2's plain scalars.

PyYAML implements YAML 1.1, where ``no``, ``off``, ``yes`` and ``on`` are booleans, ``010`` is octal 8, ``1:30`` is
the integer 90, dates become date objects and ``3e-4`` (no dot) is a string. mmgrpo reads configs with the YAML 1.2
core schema instead:

- booleans are only ``true`` / ``false`` (any case style of those two words); ``no``, ``off``, ``yes``, ``on`` are
  strings, so ``mixed_precision: no`` (accelerate's word) means the string;
- integers are decimal (``010`` is 10; ``1_000`` is 1000), floats may omit the dot (``3e-4``), ``.inf`` and ``.nan``
  are floats (which every numeric field then refuses);
- ``null``, ``~`` and an empty value are null; everything else (dates too) is a string.

Every error is a one-line [`ConfigError`] naming the source and, for syntax errors and duplicate keys, the line and
column (1-based).
"""

from __future__ import annotations

import re
from collections.abc import Hashable
from pathlib import Path
from typing import Any

import yaml

from .validation import ConfigError

_MERGE = "tag:yaml.org,2002:merge"


class StrictLoader(yaml.SafeLoader):
    """A safe loader with the YAML 1.2 core scalars described in the module docstring and no duplicate keys."""

    yaml_implicit_resolvers: dict = {}  # rebuilt below (never PyYAML's 1.1 table)

    def construct_mapping(self, node, deep=False):
        seen = {}
        for key_node, _ in node.value:
            if key_node.tag == _MERGE:
                continue
            key = self.construct_object(key_node, deep=True)
            if not isinstance(key, Hashable):
                continue  # PyYAML refuses it below with its position
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r} (first at line {seen[key].line + 1}): keep only one",
                    key_node.start_mark,
                )
            seen[key] = key_node.start_mark
        return super().construct_mapping(node, deep=deep)


def _construct_int(loader: StrictLoader, node) -> int:
    return int(loader.construct_scalar(node).replace("_", ""))


StrictLoader.add_implicit_resolver(
    "tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF")
)
StrictLoader.add_implicit_resolver("tag:yaml.org,2002:int", re.compile(r"^[-+]?[0-9][0-9_]*$"), list("-+0123456789"))
StrictLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"^(?:[-+]?(?:[0-9][0-9_]*\.[0-9_]*(?:[eE][-+]?[0-9]+)?|\.[0-9][0-9_]*(?:[eE][-+]?[0-9]+)?"
        r"|[0-9][0-9_]*[eE][-+]?[0-9]+|\.(?:inf|Inf|INF))|\.(?:nan|NaN|NAN))$"
    ),
    list("-+0123456789."),
)
StrictLoader.add_implicit_resolver(
    "tag:yaml.org,2002:null", re.compile(r"^(?:~|null|Null|NULL|)$"), ["~", "n", "N", ""]
)
StrictLoader.add_implicit_resolver(_MERGE, re.compile(r"^(?:<<)$"), ["<"])
StrictLoader.add_constructor("tag:yaml.org,2002:int", _construct_int)


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def parse_yaml(text: str, source: str) -> Any:
    """Parses `text` with [`StrictLoader`]; `source` (a file name, an override) is named in errors."""
    try:
        return yaml.load(text, Loader=StrictLoader)  # noqa: S506 (a SafeLoader subclass)
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark or err.context_mark
        where = f"{source}:{mark.line + 1}:{mark.column + 1}" if mark is not None else source
        problem = _one_line(err.problem or "")
        context = f" ({_one_line(err.context)})" if err.context and err.problem else _one_line(err.context or "")
        raise ConfigError(f"{where}: YAML error: {problem}{context}.") from None
    except (yaml.YAMLError, ValueError) as err:
        raise ConfigError(f"{source}: YAML error: {_one_line(err)}.") from None


def read_yaml(path: str | Path) -> Any:
    """Reads the YAML file `path` (an empty file is an empty mapping); errors name the file."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"Config file {path} does not exist" + (" (it is a folder)" if path.is_dir() else "") + ".")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"Config file {path} cannot be read as UTF-8 text: {_one_line(err)}.") from None
    data = parse_yaml(text, str(path))
    return {} if data is None else data


class _Dumper(yaml.SafeDumper):
    """Quotes every string that YAML 1.1 or 1.2 would read as something else (``no``, ``3e-4``...)."""


for _first, _entries in StrictLoader.yaml_implicit_resolvers.items():
    for _tag, _regexp in _entries:
        _Dumper.add_implicit_resolver(_tag, _regexp, [_first])


def dump_yaml(data: Any) -> str:
    """YAML text of plain data (mappings, lists, scalars) that [`read_yaml`] (and PyYAML's own loaders) read back to
    the same values."""
    return yaml.dump(data, Dumper=_Dumper, sort_keys=False, allow_unicode=True, width=120)
