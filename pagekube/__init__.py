"""pagekube: Kubernetes-native LLM serving (engine + operator)."""

from pathlib import Path as _Path

__version__ = "0.1.0"

# The operator's modules live in the checkout's top-level operator/ folder, which has no __init__.py so that it can
# never shadow the stdlib's `operator` (a folder without one loses to a real module on any sys.path). Installed
# wheels hold them in pagekube/operator/; in a source checkout (an editable install, whose finder maps only folders
# with an __init__.py) the checkout root joins this package's path so pagekube.operator is found there.
_checkout = _Path(__file__).resolve().parent.parent
if not (_Path(__file__).parent / "operator").is_dir() and (_checkout / "operator" / "cli.py").is_file():
    __path__.append(str(_checkout))
