"""The simulated CUDA guard and hooks: installed wherever no real GPU is seen, built with the C++
standard the installed torch's headers need."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from memlens.predict import guard

# Seconds a test, more than the quick loop (`pytest -m quick`) holds.
pytestmark = pytest.mark.slow

# A CUDA build of torch on a machine without a GPU, as seen from this CPU-only one: the build says
# CUDA is built in, the runtime finds no device. Before the fix, memlens trusted the build and
# loaded nothing, and the first backward ended in "hasPrimaryContext expects a valid device index"
# (on a CPU build the same skip shows as "not linked with support for cuda devices").
CUDA_BUILD_WITHOUT_GPU = textwrap.dedent(
    """
    import torch
    torch.backends.cuda.is_built = lambda: True
    torch.cuda.device_count = lambda: 0
    import memlens

    def step():
        weight = torch.nn.Parameter(torch.empty(256, 256, device="cuda"))
        (weight @ torch.empty(256, 8, device="cuda")).sum().backward()

    result = memlens.predict(step)
    print("fits" if result.fits else "did not fit", result.peak_allocated_bytes)
    """
)


def test_a_cuda_build_without_a_gpu_gets_the_simulated_device(tmp_path: Path) -> None:
    run = subprocess.run([sys.executable, "-c", CUDA_BUILD_WITHOUT_GPU], capture_output=True, text=True,
                         timeout=240, cwd=tmp_path, check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    verdict, peak = run.stdout.split()[-2:]
    assert verdict == "fits" and int(peak) >= 256 * 256 * 4


def test_only_a_visible_device_counts_as_real(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert not guard.has_real_cuda_device()
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert guard.has_real_cuda_device()
    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: False)
    assert not guard.has_real_cuda_device()


def _fake_compiler(folder: Path, refused: str) -> Path:
    """A "compiler" that refuses one ``-std=`` (as g++ refuses torch 2.14's headers under C++17)
    and otherwise writes the ``-o`` file; it logs each standard it was asked for."""
    script = folder / "fake-c++"
    script.write_text(textwrap.dedent(f"""\
        #!{sys.executable}
        import sys
        args = sys.argv[1:]
        standard = next(a for a in args if a.startswith("-std="))
        with open({str(folder / "asked")!r}, "a") as log:
            log.write(standard + "\\n")
        if standard == {refused!r}:
            sys.stderr.write("warning: noise\\nc10/util/intrusive_ptr.h:775: error: 'strong_ordering' is not a type\\n")
            sys.exit(1)
        open(args[args.index("-o") + 1], "wb").write(b"built")
        """))
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return script


def test_the_guard_is_built_with_cxx20_when_the_headers_need_it(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CXX", str(_fake_compiler(tmp_path, refused="-std=c++17")))
    target = tmp_path / "out" / "guard.so"
    guard._build(target)
    assert target.read_bytes() == b"built"
    assert (tmp_path / "asked").read_text().split() == ["-std=c++17", "-std=c++20"]


def test_a_failed_build_shows_the_errors_not_the_warnings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CXX", str(_fake_compiler(tmp_path, refused="-std=c++17")))
    monkeypatch.setattr(guard, "_CXX_STANDARDS", ("c++17",))
    with pytest.raises(guard.GuardBuildError) as failure:
        guard._build(tmp_path / "out" / "guard.so")
    assert "strong_ordering" in str(failure.value) and "noise" not in str(failure.value)
    assert not (tmp_path / "out" / "guard.so").exists()
    assert os.listdir(tmp_path / "out") == []


def test_a_torch_whose_hooks_are_not_found_is_told_so_before_anything_is_built(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """torch 2.1 (its hooks a plain pointer): one line naming the release and what works with it,
    not the compiler's errors of a library that could not be used anyway."""

    def never_built(target: Path) -> None:
        raise AssertionError("the library was built for hooks that cannot be patched")

    monkeypatch.setattr(guard, "_loaded", False)
    monkeypatch.setattr(guard, "has_real_cuda_device", lambda: False)
    monkeypatch.setattr(guard, "_hooks_offset", lambda: None)
    monkeypatch.setattr(guard, "_build", never_built)
    monkeypatch.setattr(guard, "_library_path", lambda: Path("/nonexistent/memlens-guard.so"))
    with pytest.raises(guard.GuardBuildError, match=r"could not find torch .*'s CUDA hooks.*record, triage"):
        guard.ensure_cuda_guard()
