"""The checkout's top-level packages must not shadow installed ones.

pytest (rootdir on sys.path for the tests/ and e2e/ packages) and `python -m ...` from the checkout put the repo
root first on sys.path, so a top-level directory named like an installed distribution's module wins over it.
transformers 5.25 started requiring HF `kernels`, and the old top-level `kernels/` then broke every import of
transformers (CI, 2026-12). pagekube's own packages live under pagekube/ or behind setuptools package-dir names.
"""

import importlib.metadata
from pathlib import Path

from tests.k8s_tools import REPO


def test_no_top_level_package_shadows_an_installed_distribution():
    ours = {p.parent.name for p in Path(REPO).glob("*/__init__.py")}
    assert {"tests", "e2e", "pagekube"} <= ours  # the glob sees the checkout
    installed = importlib.metadata.packages_distributions()
    clashes = {name: installed[name] for name in ours - {"pagekube"} if name in installed}
    assert not clashes, f"top-level directories shadow installed modules: {clashes}"


def test_the_repository_root_never_shadows_the_stdlib_operator():
    """An interpreter started in the checkout, before its site imports run (`python -S`: how vLLM's engine process
    and other tools' workers start), imports the stdlib's `operator`, not the checkout's operator/ folder."""
    import subprocess
    import sys

    for code in ["import collections", "import operator; assert operator.eq(1, 1), operator.__file__"]:
        r = subprocess.run([sys.executable, "-S", "-c", code], cwd=REPO, capture_output=True, text=True)
        assert r.returncode == 0, r.stderr


def test_pagekube_operator_imports_from_the_checkout():
    import pagekube.operator.engine_flags as flags

    assert Path(flags.__file__).parent == Path(REPO) / "operator" and flags.SCHEMA["properties"]


def test_every_engine_and_operator_package_is_in_the_distribution():
    """pyproject lists the packages by hand (package-dir maps engine/ and operator/): one left out works in the
    checkout (an editable install) and is missing from the engine image."""
    import tomllib

    listed = set(tomllib.loads((Path(REPO) / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    roots = {"engine": "pagekube.engine", "operator": "pagekube.operator", "pagekube": "pagekube"}
    on_disk = {".".join([roots[init.relative_to(REPO).parts[0]], *init.relative_to(REPO).parts[1:-1]])
               for root in roots for init in (Path(REPO) / root).rglob("__init__.py")}
    assert on_disk - listed == set()
