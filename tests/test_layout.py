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
