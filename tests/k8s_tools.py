"""Where the test tools live: built or fetched once per machine by e2e/controlplane/build.sh (cached outside the repo)."""

from __future__ import annotations

import functools
import subprocess
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))


@functools.cache
def tool_paths() -> dict[str, Path]:
    out = subprocess.run([str(REPO / "e2e/controlplane/build.sh")], check=True, capture_output=True, text=True).stdout
    return {k: Path(v) for k, v in (line.split("=", 1) for line in out.split() if "=" in line)}


def third_party_crd(filename: str) -> dict:
    return yaml.safe_load((tool_paths()["PAGEKUBE_THIRD_PARTY_CRDS"] / filename).read_text())


def third_party_crd_files() -> list[Path]:
    return sorted(tool_paths()["PAGEKUBE_THIRD_PARTY_CRDS"].glob("*.yaml"))


def kubectl() -> str:
    return str(tool_paths()["PAGEKUBE_TOOLS_BIN"] / "kubectl")


def helm() -> str:
    return str(tool_paths()["PAGEKUBE_TOOLS_BIN"] / "helm")
