"""The optional packages, as users install them: used where present, else named.

Each command that can use one works without it or says, in one `Error:` line before any rank
starts, which extra to install.

Checked without importing the package (importlib.util.find_spec), so that a check costs nothing
and a package that is present but hidden (or broken at import) counts as absent. The extras are
those of setup.cfg: `hf`, `lightning`, `stateful`, `plot`, `webdataset`, `litdata`.
"""

from __future__ import annotations

import importlib.util

from sharddemo.errors import UsageError

# what -> (the modules any one of which will do, the extra that installs one, what it is)
EXTRAS = {
    "transformers": (("transformers",), "hf", "the transformers package"),
    # users import Lightning as `pytorch_lightning` (package pytorch-lightning) or as
    # `lightning.pytorch` (package lightning): either does
    "lightning": (("pytorch_lightning", "lightning"), "lightning",
                  "Lightning (the pytorch-lightning or the lightning package)"),
    "torchdata": (("torchdata",), "stateful", "torchdata's StatefulDataLoader"),
    "matplotlib": (("matplotlib",), "plot", "matplotlib"),
    "webdataset": (("webdataset",), "webdataset", "WebDataset"),
    "litdata": (("litdata",), "litdata", "litdata's StreamingDataset"),
}


def installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def available(what: str) -> bool:
    """Whether one of the modules `what` can use is installed."""
    return any(installed(m) for m in EXTRAS[what][0])


def install_hint(what: str) -> str:
    extra = EXTRAS[what][1]
    pins = ""
    if extra == "litdata":
        # litdata needs torchvision, and pip's newest torchvision brings its own newer torch (a
        # CUDA build of several GB in place of the one installed): name both in one command
        # (docs/frameworks.md, "litdata")
        try:
            from importlib.metadata import version

            torch_version = version("torch").split("+")[0]
        except Exception:  # (no torch installed: nothing to keep)
            torch_version = None
        if torch_version:
            pins = (f" torch=={torch_version} torchvision==<the one built for torch "
                    f"{torch_version}>")
    return (f"pip install 'sharddemo[{extra}]'{pins} (from a checkout: pip install -e "
            f"'.[{extra}]'{pins})")


def missing_module_hint(exc: BaseException) -> str:
    """Return `; install the extra: ...` for an import that failed on an extra's package.

    Else nothing."""
    name = getattr(exc, "name", None) if isinstance(exc, ImportError) else None
    for what, (modules, _, _) in EXTRAS.items():
        if name is not None and name.split(".")[0] in modules:
            return f"; install the extra: {install_hint(what)}"
    return ""


def require(what: str, needed_by: str) -> None:
    """One Error line when `what` is not installed: `needed_by` needs it, and the extra."""
    if not available(what):
        raise UsageError(f"{needed_by} needs {EXTRAS[what][2]}, which is not installed; "
                         f"install the extra: {install_hint(what)}")


def require_imports_of(path: str) -> None:
    """Stop, before any rank starts, where the factory file imports an extra that is missing.

    One Error line, where the factory file `path` imports (at its top level) a package an extra
    installs that is not installed. Read, not run: the file's own code runs on the ranks only.
    """
    import ast

    try:
        with open(path, encoding="utf-8") as handle:
            tree = ast.parse(handle.read(), filename=path)
    except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
        return  # the ranks' import says what is wrong with it
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module.split(".")[0])
    for what, (modules, _, label) in EXTRAS.items():
        for name in sorted(names & set(modules)):
            if not installed(name):
                raise UsageError(f"{path} imports {name} ({label}), which is not installed; "
                                 f"install the extra: {install_hint(what)}")


# audit --trainer / --lightning: the optional package each needs
FRAMEWORKS = {"trainer": "transformers", "lightning": "lightning"}


def require_framework(kind: str) -> None:
    """One Error line, before any rank starts, when the framework is not installed."""
    require(FRAMEWORKS[kind], f"--{kind}")
