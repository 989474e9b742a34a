"""examples/train_tiny.py as a module, for tests that train the same tiny LM the samples use."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

TRAIN_TINY = Path(__file__).resolve().parents[1] / "examples" / "train_tiny.py"


def load_train_tiny() -> ModuleType:
    """Import the example once (it is a script, not a package module)."""
    if "train_tiny" in sys.modules:
        return sys.modules["train_tiny"]
    spec = importlib.util.spec_from_file_location("train_tiny", TRAIN_TINY)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["train_tiny"] = module
    spec.loader.exec_module(module)
    return module
