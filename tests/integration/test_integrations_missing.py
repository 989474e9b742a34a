"""memlens.integrations without the frameworks: the package imports none of them, and each
integration says which extra installs its framework. Runs whether or not the extras are there:
a framework is hidden by putting None in ``sys.modules``, which makes importing it fail as a
missing module would."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

from memlens.errors import MemlensUsageError
from memlens.integrations import MissingExtraError
from tests.conftest import REPO_ROOT

HIDDEN = {
    "huggingface": (["transformers"], "memlens[hf]"),
    "lightning": (["lightning", "lightning.pytorch", "pytorch_lightning"], "memlens[lightning]"),
    "accelerate": (["accelerate"], "memlens[accelerate]"),
}


def test_importing_the_package_imports_no_framework() -> None:
    code = (
        "import sys, memlens.integrations as i\n"
        "heavy = ('transformers', 'lightning', 'pytorch_lightning', 'accelerate', 'torch')\n"
        "loaded = [m for m in heavy if m in sys.modules]\n"
        "assert not loaded, loaded\n"
        "assert issubclass(i.MissingExtraError, ImportError)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("integration", sorted(HIDDEN))
def test_a_missing_framework_names_the_extra(integration: str, monkeypatch: pytest.MonkeyPatch) -> None:
    modules, extra = HIDDEN[integration]
    for module in modules:
        monkeypatch.setitem(sys.modules, module, None)
    monkeypatch.delitem(sys.modules, f"memlens.integrations.{integration}", raising=False)
    with pytest.raises(MissingExtraError) as raised:
        importlib.import_module(f"memlens.integrations.{integration}")
    assert f"pip install '{extra}'" in str(raised.value)
    # A usage error for the CLI (one line, exit 2) and an ImportError for importorskip.
    assert isinstance(raised.value, MemlensUsageError) and isinstance(raised.value, ImportError)
    monkeypatch.delitem(sys.modules, f"memlens.integrations.{integration}", raising=False)


def test_a_broken_framework_keeps_its_own_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Only the framework being absent is "install the extra"; a framework that is there but
    # fails to import (a dependency of its own missing) shows its real error.
    from memlens.integrations._framework import require

    package = tmp_path / "memlens_test_framework"
    package.mkdir()
    (package / "__init__.py").write_text("import memlens_test_missing_dependency\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ModuleNotFoundError, match="memlens_test_missing_dependency") as raised:
        require("memlens_test_framework", "hf", "huggingface")
    assert not isinstance(raised.value, MissingExtraError)
    with pytest.raises(MissingExtraError, match="memlens_test_absent"):
        require("memlens_test_absent", "hf", "huggingface")
