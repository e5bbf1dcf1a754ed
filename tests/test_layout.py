"""The layout of docs/architecture.md holds: imports run one way (no cycle), the analysis
imports neither torch nor the rank side, and the rank side never imports the analysis."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src"


def _imports() -> dict[str, set[str]]:
    """module -> the modules it imports (at any depth of the file: lazy imports count)."""
    modules = {}
    for path in (SRC / "sharddemo").rglob("*.py"):
        name = ".".join(path.relative_to(SRC).with_suffix("").parts)
        modules[name.removesuffix(".__init__")] = path
    edges: dict[str, set[str]] = {}
    for name, path in modules.items():
        out = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                for alias in node.names:
                    full = f"{node.module}.{alias.name}"
                    out.add(full if full in modules else node.module)
            elif isinstance(node, ast.Import):
                out |= {alias.name for alias in node.names}
        edges[name] = {m for m in out if m != name}
    return edges


def test_no_import_cycle():
    edges = _imports()
    local = {m: {t for t in e if t in edges} for m, e in edges.items()}
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        path.append(m)
        for t in local[m]:
            assert state.get(t) != 1, "import cycle: " + " -> ".join(path[path.index(t):] + [t])
            if t not in state:
                visit(t)
        path.pop()
        state[m] = 2

    for m in local:
        if m not in state:
            visit(m)


def test_the_analysis_and_the_rank_side_never_import_each_other():
    edges = _imports()
    for module, targets in edges.items():
        if module.startswith("sharddemo.analysis"):
            bad = {t for t in targets if t.split(".")[0] == "torch"
                   or t.startswith("sharddemo.rank") or t in ("sharddemo.collect",)}
            assert not bad, f"{module} imports {bad}"
        if module.startswith("sharddemo.rank"):
            bad = {t for t in targets if t.startswith("sharddemo.analysis")}
            assert not bad, f"{module} imports {bad}"
    # the rank side never climbs back to the parent's: no renderer, launcher, command or CLI
    parent = ("sharddemo.render", "sharddemo.plot", "sharddemo.launch", "sharddemo.commands",
              "sharddemo.cli")
    for module in [m for m in edges if m.startswith("sharddemo.rank")] + ["sharddemo.trace"]:
        bad = {t for t in edges[module] if t.startswith(parent)}
        assert not bad, f"{module} imports {bad}"
    assert "sharddemo.record" in edges and not {
        t for t in edges["sharddemo.record"] if t.startswith("sharddemo")}
