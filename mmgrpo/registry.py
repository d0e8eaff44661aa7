"""Lazy registries of plugins, keyed by file stem.

Each axis is a package (``mmgrpo.pipelines``, ``mmgrpo.algorithms``, ``mmgrpo.rewards``, ``mmgrpo.data``); each
plugin is one module in it exposing its class as ``PLUGIN``. Listing reads files without importing them, so it
pulls in no heavy dependency.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
from pathlib import Path

KINDS = {
    "pipeline": "mmgrpo.pipelines",
    "algorithm": "mmgrpo.algorithms",
    "reward": "mmgrpo.rewards",
    "data": "mmgrpo.data",
}


def _package_dirs(kind: str) -> list[Path]:
    if kind not in KINDS:
        raise ValueError(f"Unknown plugin kind {kind!r}; choose one of {sorted(KINDS)}.")
    spec = importlib.util.find_spec(KINDS[kind])
    return [Path(p) for p in (spec.submodule_search_locations or [])]


_SUMMARIES: dict[Path, tuple[tuple[int, int], str | None]] = {}  # path -> ((mtime_ns, size), summary)


def _plugin_summary(path: Path) -> str | None:
    """First docstring line if the module assigns ``PLUGIN`` at top level, else None (helper modules). Parsed once
    per version of the file (a config check asks for every plugin's summary several times)."""
    stat = path.stat()
    version = (stat.st_mtime_ns, stat.st_size)
    cached = _SUMMARIES.get(path)
    if cached is not None and cached[0] == version:
        return cached[1]
    tree = ast.parse(path.read_text(encoding="utf-8"))
    defines_plugin = any(
        isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "PLUGIN" for t in node.targets)
        for node in tree.body
    )
    doc = ast.get_docstring(tree) or ""
    summary = (doc.strip().splitlines()[0] if doc.strip() else "") if defines_plugin else None
    _SUMMARIES[path] = (version, summary)
    return summary


def available(kind: str) -> dict[str, str]:
    """Names of the registered plugins of `kind` with their one-line descriptions, without importing them."""
    found = {}
    for folder in _package_dirs(kind):
        for path in sorted(folder.glob("*.py")):
            if path.stem.startswith("_"):
                continue
            summary = _plugin_summary(path)
            if summary is not None:
                found[path.stem] = summary
    return found


def get(kind: str, name: str) -> type:
    """Imports plugin `name` of `kind` and returns its class.

    Raises:
        ValueError: naming the registered choices when `name` is unknown.
    """
    names = available(kind)
    if name not in names:
        raise ValueError(
            f"Unknown {kind} {name!r}. Registered {kind}s: {', '.join(sorted(names)) or 'none'}. "
            f"A {kind} is a module in {KINDS[kind]} that defines PLUGIN."
        )
    return importlib.import_module(f"{KINDS[kind]}.{name}").PLUGIN
