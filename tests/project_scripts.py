"""Import one of the project's scripts (`scripts/NAME.py`, which are not a package) as a module, for the tests
that check what a script computes rather than running it as a process."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def load_script(name: str) -> ModuleType:
    """scripts/`name`.py as the module `name` (registered in sys.modules, so its dataclasses and pickling work)."""
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
