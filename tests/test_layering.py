"""The import layering of src/shardsafe, checked on the source (ast): a module may import only from
its own unit or from a lower layer, never from a higher one, nor from another unit of its own layer.
Every unit is a whole folder (a package) or a top-level module: the folders form a stack.

Layers, lowest first (the real graph; docs/architecture.md explains each):

  0  errors, version
  1  knobs, display                 (tunables; text tables and sizes)
1.5 deadline                       (time budgets, absolute deadlines)
1.75 workers                       (blocking calls on daemon threads, under a deadline)
  2  coord                          (the only code that talks to the rendezvous store)
  3  storage                        (the storage protocols and backends: local POSIX, fsspec)
  4  format                         (manifest, typed values, data files, the save id and data file names)
  5  catalog                        (what a checkpoint is on storage: names, references, the delete rule)
  7  state                          (user state <-> flat tensors and values, both directions)
  8  engine                         (save, load, commit, read, verify, inspect, delete)
8.5 integration                    (what the Lightning integrations share: their strategies' options)
  9  manager, interop, runtime, fabric, lightning
 10  shardsafe (__init__: the public API)
10.5 accelerate, transformers      (Hugging Face integrations: the public API only)
 11  cli
 12  __main__                       (``python -m shardsafe``)
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src"
PKG = SRC / "shardsafe"

LAYERS: dict[str, float] = {
    "shardsafe.errors": 0,
    "shardsafe.version": 0,
    "shardsafe.knobs": 1,
    "shardsafe.display": 1,
    "shardsafe.deadline": 1.5,
    "shardsafe.workers": 1.75,
    "shardsafe.coord": 2,
    "shardsafe.storage": 3,
    "shardsafe.format": 4,
    "shardsafe.catalog": 5,
    "shardsafe.state": 7,
    "shardsafe.progress": 7.5,
    "shardsafe.engine": 8,
    "shardsafe.integration": 8.5,
    "shardsafe.manager": 9,
    "shardsafe.interop": 9,
    "shardsafe.runtime": 9,
    "shardsafe.fabric": 9,
    "shardsafe.lightning": 9,
    "shardsafe": 10,
    "shardsafe.accelerate": 10.5,
    "shardsafe.transformers": 10.5,
    "shardsafe.cli": 11,
    "shardsafe.__main__": 12,
}


def _unit(module: str) -> str:
    """The most specific entry of LAYERS that ``module`` falls under."""
    best = ""
    for unit in LAYERS:
        if (module == unit or module.startswith(unit + ".")) and len(unit) > len(best):
            best = unit
    assert best, module
    return best


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_module(name: str) -> bool:
    rel = Path(*name.split("."))
    return (SRC / rel).with_suffix(".py").exists() or (SRC / rel / "__init__.py").exists()


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every shardsafe module ``path`` imports, at any depth (lazy imports too)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "shardsafe"]
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}:{node.lineno}: use absolute imports"
            if node.module is None or node.module.split(".")[0] != "shardsafe":
                continue
            for alias in node.names:  # ``from shardsafe import knobs`` imports the module shardsafe.knobs
                sub = f"{node.module}.{alias.name}"
                found.append((node.lineno, sub if _is_module(sub) else node.module))
    return found


def _violations() -> list[str]:
    bad = []
    for path in sorted(PKG.rglob("*.py")):
        importer = _module_name(path)
        mine = _unit(importer)
        for line, imported in _imports(path):
            theirs = _unit(imported)
            if theirs == mine:
                continue
            if LAYERS[theirs] >= LAYERS[mine]:
                bad.append(
                    f"{path.relative_to(SRC)}:{line}: {importer} (layer {LAYERS[mine]}, {mine}) imports "
                    f"{imported} (layer {LAYERS[theirs]}, {theirs})"
                )
    return bad


def test_no_module_imports_from_a_higher_or_sibling_layer() -> None:
    bad = _violations()
    assert not bad, "layering violations:\n" + "\n".join(bad)


def test_every_module_has_a_layer() -> None:
    for path in PKG.rglob("*.py"):
        assert _unit(_module_name(path)) in LAYERS


def test_the_check_catches_an_upward_import(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text("from shardsafe.engine.read import plan_reads\nfrom shardsafe import knobs\n")
    got = [(LAYERS[_unit(m)], m) for _, m in _imports(probe)]
    assert got == [(8, "shardsafe.engine.read"), (1, "shardsafe.knobs")]
    assert LAYERS[_unit("shardsafe.state.restore")] < LAYERS[_unit("shardsafe.engine.read")]  # the old violation


def _is_package(unit: str) -> bool:
    return (SRC / Path(*unit.split("."))).is_dir()


def test_every_unit_below_the_api_is_a_whole_folder_or_a_top_level_module() -> None:
    """No folder is split into layers of its own (as ``storage.refs`` once was)."""
    for unit in LAYERS:
        if unit == "shardsafe":
            continue
        parts = unit.split(".")
        assert len(parts) == 2, f"{unit}: a layer is a folder or a top-level module, not a piece of one"


def test_no_import_cycle_between_folders() -> None:
    """The graph of package-to-package imports (lazy imports included) has no cycle."""
    graph: dict[str, set[str]] = {}
    for path in sorted(PKG.rglob("*.py")):
        mine = _unit(_module_name(path))
        for _, imported in _imports(path):
            theirs = _unit(imported)
            if theirs != mine:
                graph.setdefault(mine, set()).add(theirs)
    state: dict[str, int] = {}

    def visit(node: str, trail: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                raise AssertionError("import cycle: " + " -> ".join([*trail, node, nxt]))
            if nxt not in state:
                visit(nxt, [*trail, node])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [])
    assert any(_is_package(u) for u in graph)
