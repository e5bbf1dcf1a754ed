"""CI runs the README's own test command, word for word."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src" / "sharddemo"


def readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    block = text.split("```bash", 1)[1].split("```", 1)[0]
    return [line for line in block.splitlines() if line.strip() and not line.startswith("#")]


def test_ci_runs_the_readme_test_command():
    install_and_run, install_and_test = readme_commands()[:2]
    assert "sharddemo compare" in install_and_run
    assert "pytest" in install_and_test
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert install_and_test in ci


def test_readme_pins_the_cpu_torch_before_anything_pulls_torch():
    for command in readme_commands()[:2]:
        assert command.index("pip install torch==2.13.0") < command.index("pip install -e")


def test_test_comments_point_only_at_files_the_repo_has():
    """A comment that sends the reader to a document must send them somewhere real."""
    import re

    root = Path(__file__).resolve().parents[2]
    named = set()
    for path in (root / "tests").rglob("*.py"):
        named |= set(re.findall(r"\b((?:[\w-]+/)*[\w-]+\.md)\b", path.read_text()))
    missing = [n for n in sorted(named) if not list(root.glob(f"**/{n}"))]
    assert not missing, f"tests point at files the repository does not have: {missing}"


def test_the_shipped_code_has_no_hidden_switches_and_no_private_imports():
    """Fault injection lives in tests/support/faultplugin; modules use each other's public names;
    the sources module does not shadow HF `datasets`."""
    import ast

    src = ROOT / "src" / "sharddemo"
    assert not (src / "datasets.py").exists()
    paths = sorted(src.rglob("*.py"))
    assert any(p.parent != src for p in paths)  # every folder is walked, not the top level only
    for path in paths:
        text = path.read_text()
        import re

        assert not re.search(r"INJECT|_FAULT|os\.kill\(os\.getpid", text), \
            f"{path.name} holds a fault switch"
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("sharddemo"):
                private = [a.name for a in node.names
                           if a.name.startswith("_") and not a.name.startswith("__")]
                assert not private, f"{path.name} imports private {private} from {node.module}"


def test_slurm_script_passes_cpus_per_task_to_srun():
    """Since SLURM 22.05 srun does not inherit --cpus-per-task from sbatch."""
    import re

    script = (ROOT / "accelerate_configs" / "slurm-2node.sbatch").read_text()
    srun = [line for line in script.splitlines() if line.strip().startswith("srun")]
    assert srun and all(re.search(r"--cpus-per-task[= ]\"?\$SLURM_CPUS_PER_TASK", line)
                        for line in srun), srun


def test_no_dead_error_classes():
    """Every exception class errors.py declares is raised, caught or re-exported somewhere else
    in src/ (a class nothing uses is a promise the code does not keep)."""
    import re

    declared = re.findall(r"^class (\w+)\(", (SRC / "errors.py").read_text(), re.M)
    assert "UsageError" in declared  # (the pattern reads the file)
    others = "\n".join(path.read_text() for path in SRC.rglob("*.py")
                       if path.name != "errors.py")
    unused = [name for name in declared if not re.search(rf"\b{name}\b", others)]
    assert not unused, f"errors.py declares classes nothing else uses: {unused}"


def test_every_tests_path_the_repository_names_exists():
    """A file under tests/ named anywhere (the docs, the CI scripts, the code's comments, the
    tests themselves), and the test function after its `::`, is where the name says: the
    folders (unit/, ranks/, scripts/, support/) are part of the name."""
    import re

    files = [ROOT / name for name in ("README.md", "CONTRIBUTING.md", "setup.cfg",
                                      "pyproject.toml", ".ci/run", ".ci/lowest")]
    for folder in ("docs", "src", "tests", "benchmarks", "examples"):
        files += [p for p in (ROOT / folder).rglob("*")
                  if p.suffix in (".py", ".md") and "__pycache__" not in p.parts]
    named = re.compile(r"(?<![\w/.-])tests/((?:[\w-]+/)*[\w-]+(?:\.py)?)(?:::(\w+))?")
    wrong = []
    for path in files:
        for found in named.finditer(path.read_text()):
            target = ROOT / "tests" / found[1]
            if found[1].startswith("no_such"):
                continue  # a test's own missing file
            if not target.exists() or found[2] and not re.search(
                    rf"^def {found[2]}\(", target.read_text(), re.M):
                wrong.append(f"{path.relative_to(ROOT)}: {found[0]}")
    assert not wrong, "names of test files or tests that do not exist:\n" + "\n".join(wrong)
