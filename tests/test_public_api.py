"""The public face in ``memlens/__init__.py``: typed entry points that mirror the functions they
call, imported lazily, and the subpackages reachable after a bare ``import memlens``."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import memlens
from memlens.recorder import Recorder
from tests.conftest import REPO_ROOT

# entry point -> the module whose function of the same name it calls
FRONT_DOOR = {
    "analyze": "memlens.analysis",
    "record": "memlens.recorder.session",
    "whatif": "memlens.allocator.replay",
    "predict": "memlens.predict.session",
    "plan": "memlens.plan",
}


def run_fresh(script: str) -> None:
    """Run ``script`` in a new interpreter: what ``import memlens`` imports, and the ``predict``
    function before ``import memlens.predict`` rebinds the name to the subpackage."""
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], cwd=REPO_ROOT,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("name", sorted(FRONT_DOOR))
def test_each_entry_point_mirrors_the_function_it_calls(name: str) -> None:
    # Names, kinds, defaults and annotations (strings, under ``from __future__ import
    # annotations``: equal text, equal types) of every parameter, and the return annotation.
    run_fresh(f"""
        import importlib, inspect, memlens
        front = inspect.signature(memlens.{name})
        real = inspect.signature(getattr(importlib.import_module({FRONT_DOOR[name]!r}), {name!r}))
        assert front == real, (str(front), str(real))
        assert front.return_annotation == real.return_annotation != inspect.Signature.empty
    """)


def test_record_passes_every_option_through(tmp_path: Path) -> None:
    recorder = memlens.record(tmp_path, device="cpu", name="mirrored", max_entries=1234, stacks="none",
                              dump_every=3)
    assert isinstance(recorder, Recorder)
    assert (recorder.out, recorder.name, recorder.max_entries, recorder.stacks) == (tmp_path, "mirrored", 1234, "none")


def test_a_misspelt_option_is_a_type_error_at_the_call() -> None:
    with pytest.raises(TypeError, match="capacty"):
        memlens.whatif("unused.pickle", capacty=1)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="'stack'"):
        memlens.record("unused", stack="none")  # type: ignore[call-arg]


def test_bare_import_is_light_and_reaches_every_subpackage() -> None:
    run_fresh("""
        import sys, memlens
        heavy = [m for m in ("torch", "dash", "memlens.analysis", "memlens.budget", "memlens.recorder")
                 if m in sys.modules]
        assert not heavy, heavy
        assert callable(memlens.budget.estimate) and "memlens.budget" in sys.modules
        assert "budget" in dir(memlens) and "budget" in memlens.__all__
        from memlens import *  # every name in __all__ resolves
        assert memlens.allocator.whatif is sys.modules["memlens.allocator"].whatif
        try:
            memlens.no_such_thing
        except AttributeError as error:
            assert "no_such_thing" in str(error)
        else:
            raise AssertionError("memlens.no_such_thing did not raise")
        assert memlens.predict.__module__ == "memlens"  # the function, until...
        import memlens.predict
        assert type(memlens.predict).__name__ == "_CallablePackage" and callable(memlens.predict)
    """)
