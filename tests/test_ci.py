"""CI runs the README's own test command, word for word."""

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


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
