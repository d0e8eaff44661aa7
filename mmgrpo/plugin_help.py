"""``mmgrpo show NAME``: a plugin's options (type, default, documentation) read from its ``Config`` dataclass, and
``mmgrpo --version``: the versions of mmgrpo and of the libraries it pins."""

from __future__ import annotations

import dataclasses
import re
import typing
from importlib import metadata

from . import __version__, registry
from .validation import is_embedded

PINNED = ("torch", "torchvision", "diffusers", "transformers", "accelerate", "peft", "open-clip-torch")
# documented arguments in a Hugging Face docstring: ``name (`type`, *optional*): text``, or several sharing a text,
# ``low (`float`), high (`float`): text``
_ARG = re.compile(r"^(\s*)(\w+ \(`.*?\)(?:, \w+ \(`.*?\))*):\s(.*)$")
_NAME = re.compile(r"(\w+) \(`")


def version_text() -> str:
    """``mmgrpo X.Y.Z`` and the installed versions of the pinned libraries, without importing them."""
    found = []
    for name in PINNED:
        try:
            found.append(f"{name} {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            found.append(f"{name} (not installed)")
    return f"mmgrpo {__version__} ({', '.join(found)})"


def argument_docs(docstring: str | None) -> dict[str, str]:
    """The text of each argument documented under ``Args:`` in a Hugging Face style docstring, continuation lines
    joined (nested bullet lists kept on their own lines). Linear in the docstring's length."""
    docs: dict[str, list[str]] = {}
    current: list[str] | None = None
    indent, in_args = 0, False
    for line in (docstring or "").splitlines():
        stripped = line.strip()
        if stripped in ("Args:", "Arguments:", "Parameters:"):
            in_args, current = True, None
            continue
        if not in_args:
            continue
        if stripped in ("Returns:", "Raises:", "Example:", "Examples:", "Attributes:"):
            break
        match = _ARG.match(line)
        if match and (current is None or len(match.group(1)) <= indent):
            current, indent = [match.group(3).strip()], len(match.group(1))
            for name in _NAME.findall(match.group(2)):
                docs[name] = current  # arguments documented together share one text
        elif current is not None and stripped:
            current.append(("\n" if stripped.startswith("- ") else " ") + stripped)
    return {name: "".join(parts).strip() for name, parts in docs.items()}


def _type_name(tp) -> str:
    if isinstance(tp, str):
        return tp
    if typing.get_origin(tp) is typing.Literal:
        return " | ".join(repr(v) for v in typing.get_args(tp))
    if typing.get_origin(tp) is typing.Union:  # Optional[Literal[...]] and the like: each member spelled out
        return " | ".join("None" if arg is type(None) else _type_name(arg) for arg in typing.get_args(tp))
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _default(field: dataclasses.Field) -> str:
    if field.default is not dataclasses.MISSING:
        return repr(field.default)
    if field.default_factory is not dataclasses.MISSING:
        return repr(field.default_factory())
    return "(required)"


def _options(config: type) -> list[tuple[str, str, str, str]]:
    """``(name, type, default, doc)`` of every key a mapping of dataclass `config` holds: its own fields and, in their
    place, the fields of its embedded records with this config's defaults (see [`mmgrpo.validation.embedded`]). A
    record field's doc is the config's own where it documents the key, else the record's; a field's doc is the
    config's, else its nearest base class's."""
    # a config that extends another (``FluxKontextConfig(FluxConfig)``) documents only what it adds or changes
    docs = {k: v for cls in reversed(config.__mro__) for k, v in argument_docs(cls.__doc__).items()}
    hints, rows = typing.get_type_hints(config), []
    for field in dataclasses.fields(config):
        if not field.init:
            continue
        if not is_embedded(field):
            rows.append((field.name, _type_name(hints.get(field.name, field.type)), _default(field),
                         docs.get(field.name, "(undocumented)")))
            continue
        record = field.default_factory()  # this config's defaults of the record's fields
        inner_docs, inner_hints = argument_docs(type(record).__doc__), typing.get_type_hints(type(record))
        for inner in dataclasses.fields(record):
            if inner.init:
                doc = docs.get(inner.name) or inner_docs.get(inner.name, "(undocumented)")
                rows.append((inner.name, _type_name(inner_hints[inner.name]), repr(vars(record)[inner.name]), doc))
    return rows


def find(name: str, kind: str | None = None) -> tuple[str, type]:
    """``(kind, plugin class)`` of the plugin called `name` (of `kind` when given): a listed name, or a
    ``module:attribute`` spec of the user's own code while user code is allowed (``--allow-plugins``), imported and
    checked against its kind's declarations as ``mmgrpo train`` does ([`mmgrpo.registry.get`]).

    Raises:
        `ValueError`: no plugin has that name (the message lists them), or several kinds do and `kind` is unset; a spec
            while user code is not allowed, or one that is no plugin of `kind` (of any kind when unset).
    """
    kinds = [kind] if kind else list(registry.KINDS)
    matches = [k for k in kinds if name in registry.available(k)]
    if not matches and registry.is_spec(name):
        return _find_spec(name, kinds)
    if not matches:
        known = {k: sorted(registry.available(k)) for k in kinds}
        raise ValueError(f"no plugin {name!r}{f' of kind {kind!r}' if kind else ''}; registered: {known}")
    if len(matches) > 1:
        raise ValueError(f"{name!r} names plugins of several kinds ({', '.join(matches)}): add --kind {matches[0]} (or another)")
    return matches[0], registry.get(matches[0], name)


def _find_spec(name: str, kinds: list[str]) -> tuple[str, type]:
    """``(kind, plugin class)`` of ``module:attribute`` `name`: the kind among `kinds` whose declarations it passes."""
    if not registry.resolvable(kinds[0], name):
        raise ValueError(f"{name!r} names code of your own to import (module {name.split(':')[0]}), which runs that "
                         "code: pass --allow-plugins to show it.")
    found, errors = {}, {}
    for kind in kinds:
        try:
            found[kind] = registry.get(kind, name)
        except ValueError as err:
            errors[kind] = str(err)
    if len(found) > 1:
        raise ValueError(f"{name!r} passes the checks of several kinds ({', '.join(found)}): add --kind "
                         f"{next(iter(found))} (or another)")
    if not found:
        if len(kinds) == 1 or len(set(errors.values())) == 1:  # one kind asked, or an import error
            raise ValueError(next(iter(errors.values())))
        raise ValueError(f"{name!r} is no plugin of any kind: " + "; ".join(f"as a {k}: {e}" for k, e in errors.items()))
    return next(iter(found.items()))


def describe(name: str, kind: str | None = None) -> str:
    """The text ``mmgrpo show`` prints: the plugin's summary, then one entry per option (name, type, default, doc).

    Raises:
        `ValueError`: see [`find`]; a plugin without a ``Config`` dataclass.
    """
    kind, plugin = find(name, kind)
    config = plugin.Config  # every plugin declares its Config (mmgrpo.protocols)
    if not dataclasses.is_dataclass(config):
        raise ValueError(f"{kind} {name!r} ({plugin.__name__}) has no Config dataclass to describe")
    summary = (plugin.__doc__ or "").strip().split("\n\n")[0]
    lines = [f"{kind} {name}: {' '.join(summary.split())}", "", f"options ({kind} section of a config):"]
    for option, type_name, default, doc in _options(config):
        lines.append(f"  {option}: {type_name} = {default}")
        lines.extend(f"      {doc_line.strip()}" for doc_line in doc.splitlines())
    return "\n".join(lines)
