"""Lazy registries of plugins: the built-in ones, installed third-party ones, and a user's own code by
``module:attribute``.

Each axis is a package (``mmgrpo.pipelines``, ``mmgrpo.algorithms``, ``mmgrpo.rewards``, ``mmgrpo.data``); each
built-in plugin is one module in it exposing its class as ``PLUGIN``, registered by its file stem. An installed
distribution adds plugins through entry points in the group of the same name (``[project.entry-points."mmgrpo.rewards"]
my_reward = "my_pkg.rewards:MyReward"``); a built-in name wins over an entry point of the same name. Listing reads
files and package metadata without importing them, so it pulls in no heavy dependency and runs no third-party code.

A name of the form ``module:attribute`` (``my_pkg.rewards:MyReward``) names a plugin in the user's own code, anywhere
a plugin name is accepted. Importing it runs that module's code, so, like a model's own code
([`mmgrpo.preflight.check_remote_code`]), it is imported only when the command line allows it: ``--allow-plugins``
([`allow_user_code`] from Python). An installed entry point needs no flag: installing the distribution was the
user's choice, and it can only name what the distribution declares. Every plugin that is not built in passes the
declaration checks of [`mmgrpo.plugin_contract`] when it is loaded, before any model loads; a plain function is
accepted as a reward ([`mmgrpo.function_reward`]).
"""

from __future__ import annotations

import ast
import functools
import importlib
import importlib.util
import re
import sys
from importlib import metadata
from importlib.machinery import PathFinder
from pathlib import Path

KINDS = {
    "pipeline": "mmgrpo.pipelines",
    "algorithm": "mmgrpo.algorithms",
    "reward": "mmgrpo.rewards",
    "data": "mmgrpo.data",
}
ENTRY_POINT_GROUPS = dict(KINDS)  # kind -> the entry-point group of installed plugins (the axis's package name)
SPEC = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*$")  # module:attribute
_USER_CODE = {"allowed": False}  # set by --allow-plugins (allow_user_code)


def allow_user_code(allowed: bool = True) -> None:
    """Lets (or stops letting) this process import ``module:attribute`` plugins: what ``--allow-plugins`` says."""
    _USER_CODE["allowed"] = allowed


def is_spec(name: str) -> bool:
    """Whether plugin `name` has the form ``module:attribute`` (the user's own code)."""
    return bool(SPEC.match(name))


def _package_dirs(kind: str) -> list[Path]:
    if kind not in KINDS:
        raise ValueError(f"Unknown plugin kind {kind!r}; choose one of {sorted(KINDS)}.")
    spec = importlib.util.find_spec(KINDS[kind])
    return [Path(p) for p in (spec.submodule_search_locations or [])]


_SUMMARIES: dict[tuple[Path, str], tuple[tuple[int, int], str | None]] = {}  # (path, name) -> (version, summary)


_SENTENCE = re.compile(r"(.+?[.!?][)\"']?)(?=\s+[A-Z`(\[]|$)")  # up to the first full stop before a capital


def _first_sentence(doc: str | None) -> str:
    """The first sentence of a docstring's first paragraph, its lines joined ("" for none)."""
    paragraph = " ".join((doc or "").strip().split("\n\n")[0].split())
    match = _SENTENCE.match(paragraph)
    return match.group(1) if match else (paragraph + "." if paragraph else "")


def _plugin_summary(path: Path, attribute: str = "PLUGIN") -> str | None:
    """The summary of a plugin's module at `path`, parsed once per version of the file (a config check asks for every
    plugin's summary several times). `attribute` ``"PLUGIN"``: a built-in module, its docstring's first sentence if
    it assigns ``PLUGIN`` at top level, else None (a helper module). Another `attribute` (an entry point's): the
    docstring of the class or function of that name, else the module's."""
    stat = path.stat()
    version = (stat.st_mtime_ns, stat.st_size)
    cached = _SUMMARIES.get((path, attribute))
    if cached is not None and cached[0] == version:
        return cached[1]
    tree = ast.parse(path.read_text(encoding="utf-8"))
    if attribute == "PLUGIN":
        defines = any(isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "PLUGIN"
                                                           for t in node.targets) for node in tree.body)
        summary = _first_sentence(ast.get_docstring(tree)) if defines else None
    else:
        defs = [node for node in tree.body if isinstance(node, (ast.ClassDef, ast.FunctionDef))
                and node.name == attribute]
        summary = _first_sentence(ast.get_docstring(defs[0]) if defs else None) or \
            _first_sentence(ast.get_docstring(tree))
    _SUMMARIES[(path, attribute)] = (version, summary)
    return summary


def _module_file(module: str) -> Path | None:
    """The source file of `module`, found without importing it or its parent packages (None when not found)."""
    found, path = None, None
    parts = module.split(".")
    for depth in range(len(parts)):
        found = PathFinder.find_spec(".".join(parts[: depth + 1]), path)
        if found is None:
            return None
        path = found.submodule_search_locations
    origin = found.origin if found is not None else None
    return Path(origin) if origin and origin.endswith(".py") else None


def entry_points(kind: str) -> dict[str, metadata.EntryPoint]:
    """The installed third-party plugins of `kind` by name (entry points of group ``ENTRY_POINT_GROUPS[kind]``), less
    those whose name a built-in plugin has; the first distribution found wins a name two of them declare."""
    builtin = _builtin(kind)
    found: dict[str, metadata.EntryPoint] = {}
    for point in _group_entry_points(ENTRY_POINT_GROUPS[kind], tuple(sys.path)):
        if point.name not in builtin and point.name not in found:
            found[point.name] = point
    return found


@functools.lru_cache(maxsize=16)
def _group_entry_points(group: str, search_path: tuple[str, ...]) -> tuple[metadata.EntryPoint, ...]:
    """The entry points of `group` in the distributions on `search_path` (``sys.path``), read once per path: a read
    scans every installed distribution's metadata (about 10 ms), and a config check asks for each kind many times. A
    distribution installed into a folder already searched is seen by the next process."""
    return tuple(metadata.entry_points(group=group))


def _entry_summary(point: metadata.EntryPoint) -> str:
    """An installed plugin's one-line description, read from its source without importing it, and where it comes
    from (a whole sentence)."""
    module, _, attribute = point.value.partition(":")
    path = _module_file(module.strip())
    summary = (_plugin_summary(path, attribute.strip().split(".")[0]) if path else "") or "No description."
    distribution = point.dist.name if point.dist is not None else "an installed package"
    return f"{summary.rstrip('.')}. From {distribution} (entry point {point.value})."


def _builtin(kind: str) -> dict[str, str]:
    found = {}
    for folder in _package_dirs(kind):
        for path in sorted(folder.glob("*.py")):
            if path.stem.startswith("_"):
                continue
            summary = _plugin_summary(path)
            if summary is not None:
                found[path.stem] = summary
    return found


def available(kind: str) -> dict[str, str]:
    """Names of the plugins of `kind` (built-in, then installed through entry points) with their one-line
    descriptions, without importing them."""
    found = _builtin(kind)
    found.update({name: _entry_summary(point) for name, point in entry_points(kind).items()})
    return found


def resolvable(kind: str, name: str) -> bool:
    """Whether [`get`] may load plugin `name` of `kind` without refusing it for its name alone: a listed plugin, or a
    ``module:attribute`` spec while user code is allowed."""
    return name in available(kind) or (is_spec(name) and _USER_CODE["allowed"])


def get(kind: str, name: str) -> type:
    """Imports plugin `name` of `kind` (a built-in or installed name, or a ``module:attribute`` spec) and returns its
    class; a plugin that is not built in is checked against its kind's declarations first.

    Raises:
        ValueError: naming the registered choices when `name` is unknown, the flag to pass when `name` is a spec and
            user code is not allowed, or the missing declaration of a plugin that is not built in.
    """
    from .plugin_contract import check_plugin, load_spec

    if name in _builtin(kind):
        return importlib.import_module(f"{KINDS[kind]}.{name}").PLUGIN
    points = entry_points(kind)
    if name in points:
        return check_plugin(kind, points[name].load(), f"entry point {name!r} ({points[name].value})")
    if is_spec(name):
        if not _USER_CODE["allowed"]:
            raise ValueError(
                f"{name!r} names code of your own to import (module {name.split(':')[0]}), which runs that code: "
                "pass --allow-plugins on the command line to allow it (a config file alone cannot), or install it "
                f"with an entry point in group {ENTRY_POINT_GROUPS[kind]!r} and use its name."
            )
        return check_plugin(kind, load_spec(name), name)
    names = available(kind)
    raise ValueError(
        f"Unknown {kind} {name!r}. Registered {kind}s: {', '.join(sorted(names)) or 'none'}. "
        f"A {kind} is a module in {KINDS[kind]} that defines PLUGIN, an installed entry point of group "
        f"{ENTRY_POINT_GROUPS[kind]}, or your own code named module:attribute (with --allow-plugins)."
    )
