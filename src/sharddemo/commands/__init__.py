"""Every command's orchestration, one module per command: cli.py parses (click) and calls
one function here, which refuses what it cannot run, starts the launches (sharddemo.launch),
turns traces into reports (sharddemo.analysis) and prints them.

- compare.py, trap.py, audit.py, resume.py (`audit --resume-at`, `compare --modes resume`):
  the launched commands; launches.py, what their launches share; output.py, what they write;
- check.py, lineage.py, configs.py, version.py: the commands that launch nothing;
- ranks.py: the commands a launched rank runs (`run`, `audit-rank`, ...), the parent's one
  door to the rank side (imported there lazily; tests/unit/test_layout.py).
"""
