"""The layout of docs/architecture.md holds for every file of src/ (lazy imports inside
functions included): each folder is one side, imports run one way, no cycle.

- the parent and the shared code (the top level of `sharddemo`, commands/, launch/, options/,
  integrations/) never import torch or a library built on it; they reach the rank side or the
  watch only lazily, and only in one module, where a process becomes a rank
  (commands/ranks.py: the rank commands, `--version`'s question to torch, a failing rank's
  word), or where a user asks for the watch (integrations' lazy re-export);
- the shared, torch-free modules (options, record, errors, ...) import no side at all;
- rank/ never imports the analysis, the watch or the parent; the analysis never imports
  torch, rank/ or the watch; the watch may import rank/ and the analysis, never the parent.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"

# torch and the libraries that import it when imported
HEAVY = {"torch", "accelerate", "transformers", "lightning", "pytorch_lightning", "datasets",
         "webdataset", "torchdata", "ray", "litdata"}
SHARED = {"sharddemo.options", "sharddemo.options.declare", "sharddemo.options.modes",
          "sharddemo.options.gather", "sharddemo.options.run", "sharddemo.options.audit",
          "sharddemo.options.resume", "sharddemo.options.refusals", "sharddemo.options.handoff",
          "sharddemo.record", "sharddemo.errors", "sharddemo.fileio",
          "sharddemo.sizes", "sharddemo.extras", "sharddemo.config", "sharddemo.targets",
          "sharddemo.progress", "sharddemo.lifeline", "sharddemo.lineage_format",
          "sharddemo.mesh"}
PARENT_ONLY = ("sharddemo.cli", "sharddemo.commands", "sharddemo.launch", "sharddemo.render",
               "sharddemo.plot", "sharddemo.testing", "sharddemo.check")
# the one module of the parent side that may import the rank side or the watch, lazily (inside
# a function): the CLI reaches the ranks only through it
LAZY_DOORS = {"sharddemo.commands.ranks"}


def _modules() -> dict[str, Path]:
    modules = {}
    for path in (SRC / "sharddemo").rglob("*.py"):
        name = ".".join(path.relative_to(SRC).with_suffix("").parts)
        modules[name.removesuffix(".__init__")] = path
    return modules


def _imports() -> dict[str, dict[str, bool]]:
    """module -> {imported module: imported at the top (True) or only lazily (False)}."""
    modules = _modules()
    edges: dict[str, dict[str, bool]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        top_nodes = set()
        for node in tree.body:  # module level, `if`/`try` blocks included
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                top_nodes |= {id(n) for n in ast.walk(node)}
        out: dict[str, bool] = {}
        for node in ast.walk(tree):
            found = []
            if isinstance(node, ast.ImportFrom) and node.module:
                for alias in node.names:
                    full = f"{node.module}.{alias.name}"
                    found.append(full if full in modules else node.module)
            elif isinstance(node, ast.Import):
                found = [alias.name for alias in node.names]
            for target in found:
                if target != name:
                    out[target] = out.get(target, False) or id(node) in top_nodes
        edges[name] = out
    return edges


SIDES = ("rank", "watching", "analysis")
# the parent's folders; the parent is also every module at the top of the package (options/
# holds shared modules: SHARED names them)
PARENT_FOLDERS = ("commands", "integrations", "launch", "options")


def _side(module: str) -> str:
    """The side a module of sharddemo is on, from its folder; "unknown" for a folder the
    layout does not name (a new folder must be given its side here and in
    docs/architecture.md, never taken for the parent's by default)."""
    parts = module.split(".")
    if parts[0] != "sharddemo":
        return "unknown"
    if len(parts) > 1 and parts[1] in SIDES:
        return parts[1]
    if len(parts) <= 2 and not (SRC / "sharddemo" / parts[-1]).is_dir() or module == "sharddemo":
        return "parent"  # a module at the top of the package, or the package itself
    if parts[1] in PARENT_FOLDERS:
        return "parent"
    return "unknown"


def test_every_src_module_is_on_one_side():
    sides = {m: _side(m) for m in _modules()}
    unknown = sorted(m for m, side in sides.items() if side == "unknown")
    assert not unknown, f"modules in a folder the layout does not name: {unknown}"
    assert set(sides.values()) == {"rank", "watching", "analysis", "parent"}, sides


def test_a_module_in_a_folder_the_layout_does_not_name_has_no_side():
    """The rule above, on names worked out by hand: the fallback never calls a new folder's
    module the parent's."""
    assert _side("sharddemo.cli") == "parent" and _side("sharddemo") == "parent"
    assert _side("sharddemo.commands.audit") == "parent"
    assert _side("sharddemo.launch.watchdog") == "parent"
    assert _side("sharddemo.options.run") == "parent"
    assert _side("sharddemo.rank.frameworks.lightning") == "rank"
    assert _side("sharddemo.analysis") == "analysis"
    assert _side("sharddemo.newfolder.thing") == "unknown"
    assert _side("torch.nn") == "unknown"


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


def test_the_parent_side_never_imports_torch_even_lazily():
    for module, targets in _imports().items():
        if _side(module) != "parent":
            continue
        heavy = {t for t in targets if t.split(".")[0] in HEAVY}
        assert not heavy, f"{module} imports {heavy}: that belongs under rank/ or watching/"


def test_the_parent_reaches_the_ranks_and_the_watch_only_lazily_and_only_through_one_door():
    for module, targets in _imports().items():
        if _side(module) != "parent":
            continue
        for target, at_top in targets.items():
            if _side(target) in ("rank", "watching") and target.startswith("sharddemo"):
                assert not at_top, f"{module} imports {target} at its top"
                assert module in LAZY_DOORS, f"{module} imports {target}"


def test_the_shared_modules_import_no_side():
    edges = _imports()
    for module in SHARED:
        assert module in edges, f"{module} is gone: update SHARED"
        bad = {t for t in edges[module] if t.startswith("sharddemo")
               and (t not in SHARED or _side(t) != "parent")}
        assert not bad, f"{module} imports {bad}"


def test_the_sides_import_one_way():
    for module, targets in _imports().items():
        side = _side(module)
        for target in targets:
            if not target.startswith("sharddemo") and target.split(".")[0] != "torch":
                continue
            other = _side(target) if target.startswith("sharddemo") else "torch"
            if side == "analysis":
                assert other in ("analysis", "parent") and not target.startswith(PARENT_ONLY), \
                    f"{module} imports {target}"
            if side == "rank":
                assert other in ("rank", "parent", "torch"), f"{module} imports {target}"
                assert not target.startswith(PARENT_ONLY), f"{module} imports {target}"
            if side == "watching":
                assert not target.startswith(PARENT_ONLY), f"{module} imports {target}"


def test_every_module_that_imports_torch_at_its_top_lives_under_rank_or_watching():
    for module, targets in _imports().items():
        if any(t.split(".")[0] in HEAVY and top for t, top in targets.items()):
            assert _side(module) in ("rank", "watching"), module


# the most lines a source file may have: one job a file (docs/architecture.md)
MOST_LINES = 600


def test_no_source_file_is_over_the_limit():
    long = {str(path.relative_to(SRC)): n for path in (SRC / "sharddemo").rglob("*.py")
            if (n := len(path.read_text().splitlines())) > MOST_LINES}
    assert not long, f"split these by noun (at most {MOST_LINES} lines a file): {long}"
