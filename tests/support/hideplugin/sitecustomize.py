"""Optional packages made absent, for tests/ranks/test_extras.py, kept out of the shipped code.

Put this folder on PYTHONPATH and set SHARDDEMO_TEST_HIDE=mod1,mod2: Python imports this module
at start-up in every process of the command (the parent, `accelerate launch`, every rank), and
each named module is then absent as if it were not installed (`import` raises
ModuleNotFoundError and importlib.util.find_spec returns None). With SHARDDEMO_TEST_RANKS_DIR
set, a rank command of sharddemo leaves a file there when it starts, so a test can tell that a
command refused before any rank started.
"""

import os
import sys

for _name in filter(None, os.environ.get("SHARDDEMO_TEST_HIDE", "").split(",")):
    sys.modules[_name] = None  # what `import` and find_spec read first

_marks = os.environ.get("SHARDDEMO_TEST_RANKS_DIR")
_argv = list(getattr(sys, "orig_argv", []))
if _marks and "sharddemo" in _argv:
    _rank_commands = {"run", "audit-rank", "resume-rank", "resume-demo-rank"}
    _after = _argv[_argv.index("sharddemo") + 1:]
    if _after and _after[0] in _rank_commands:
        with open(os.path.join(_marks, f"rank-started-{os.getpid()}"), "w") as _f:
            _f.write(" ".join(_argv))
