"""The package's import graph has no cycle: no module of `mmgrpo`, `mmgrpo.pipelines`, `mmgrpo.rewards` or
`mmgrpo.data` imports, directly or through others, a module that imports it back, counting imports inside functions
too (a lazy import that closes a cycle still ties two modules together). Read from the sources with `ast`, so it costs
no import."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {"mmgrpo": "mmgrpo", "mmgrpo.pipelines": "pipelines", "mmgrpo.rewards": "rewards", "mmgrpo.data": "data"}


def modules() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the four packages."""
    found = {}
    for package, folder in PACKAGES.items():
        for file in (ROOT / folder).rglob("*.py"):
            parts = [p for p in file.relative_to(ROOT / folder).with_suffix("").parts if p != "__init__"]
            found[".".join([package, *parts])] = file
    return found


def imported(name: str, file: Path, known: dict[str, Path]) -> set[str]:
    """The modules of `known` that module `name` (in `file`) imports anywhere in its body."""
    out = set()
    package = name if file.name == "__init__.py" else name.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(file.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(parent + ([node.module] if node.module else []))
            targets = [f"{base}.{alias.name}" for alias in node.names] + [base]
        elif isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                out.add(target)
    return out


def cycle_from(start: str, graph: dict[str, set[str]]) -> list[str] | None:
    """A path start -> ... -> start in `graph`, or None."""
    stack, seen = [(start, [start])], set()
    while stack:
        node, path = stack.pop()
        for nxt in graph[node]:
            if nxt == start:
                return path + [start]
            if nxt not in seen:
                seen.add(nxt)
                stack.append((nxt, path + [nxt]))
    return None


def test_no_module_imports_itself_back():
    known = modules()
    assert "mmgrpo.types" in known and "mmgrpo.pipelines.sd3" in known and "mmgrpo.samplers.flow_plan" in known
    graph = {name: imported(name, file, known) for name, file in known.items()}
    assert "mmgrpo.plans" in graph["mmgrpo.samplers.flow_plan"]  # the graph sees real edges
    cycles = [path for name in sorted(graph) if (path := cycle_from(name, graph))]
    assert not cycles, f"import cycle: {' -> '.join(cycles[0])}"


def test_the_cycle_check_finds_a_cycle():
    assert cycle_from("a", {"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert cycle_from("a", {"a": {"b"}, "b": set()}) is None


def test_no_source_file_is_over_400_lines():
    """Files split along their seams stay readable: every module of the package, `pipelines/`, `rewards/`, `data/`
    and `scripts/` holds at most 400 lines."""
    long = {str(f.relative_to(ROOT)): n for folder in (*PACKAGES.values(), "scripts")
            for f in (ROOT / folder).rglob("*.py") if (n := len(f.read_text(encoding="utf-8").splitlines())) > 400}
    assert not long, f"files over 400 lines: {long}"
