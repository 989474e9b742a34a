"""A CUDA device guard for a CPU-only PyTorch, so fake CUDA tensors can take part in autograd.

PyTorch's autograd records the stream of every tensor it will send a gradient to, and asks the
device guard registered for that tensor's device type. A CPU build has none for CUDA
("PyTorch is not linked with support for cuda devices"), so a ``FakeTensor`` whose device is
``cuda:0`` cannot go through ``backward()``, nor can ``.to("cuda")`` find the current device.
The guard below answers "device 0, default stream, one device"; it is a few lines of C++ built
once against the installed torch headers (about five seconds) and cached.

The autograd engine also asks ``at::accelerator`` for the stream of every CUDA gradient, and a
CPU build has no accelerator: its CUDA hooks say "no CUDA". Those hooks are a function-local
static created when torch is imported, so the library replaces the object it points at (found
through libtorch_cpu's ELF symbol table) with hooks that say "one CUDA device, device 0". Both
stay installed for the life of the process; neither changes anything for real CPU tensors (code
that asks for pinned memory or a CUDA generator gets PyTorch's "not available" errors). A CUDA
build of torch on a machine without a GPU needs the same (its guard calls the CUDA runtime, its
hooks say "no device"): the library's guard is registered after torch's, and the registry keeps
the last. Only a process that sees a real CUDA device loads nothing.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from memlens.errors import MemlensError, MemlensUsageError
from memlens.files import trusted_file, trusted_folder
from memlens.snapshot.cache import cache_dir

_SOURCE = r"""
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <memory>
namespace at { namespace {
using c10::Device; using c10::DeviceIndex; using c10::DeviceType; using c10::Stream;
const Device kDevice(DeviceType::CUDA, 0);
struct SimulatedCudaGuardImpl final : public c10::impl::DeviceGuardImplInterface {
  DeviceType type() const override { return DeviceType::CUDA; }
  Device exchangeDevice(Device) const override { return kDevice; }
  Device getDevice() const override { return kDevice; }
  void setDevice(Device) const override {}
  void uncheckedSetDevice(Device) const noexcept override {}
  Stream getStream(Device) const noexcept override { return Stream(Stream::DEFAULT, kDevice); }
  Stream exchangeStream(Stream) const noexcept override { return Stream(Stream::DEFAULT, kDevice); }
  DeviceIndex deviceCount() const noexcept override { return 1; }
  void record(void**, const Stream&, const DeviceIndex, const c10::EventFlag) const override {}
  void block(void*, const Stream&) const override {}
  bool queryEvent(void*) const override { return true; }
  void destroyEvent(void*, const DeviceIndex) const noexcept override {}
};
C10_REGISTER_GUARD_IMPL(CUDA, SimulatedCudaGuardImpl);
struct SimulatedCudaHooks final : public CUDAHooksInterface {
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return true; }
  bool hasCUDA() const override { return true; }
  int getNumGPUs() const override { return 1; }
  DeviceIndex current_device() const override { return 0; }
  bool hasPrimaryContext(DeviceIndex) const override { return true; }
  DeviceIndex deviceCount() const override { return 1; }
  DeviceIndex getCurrentDevice() const override { return 0; }
  void init() const override {}
};
} }
extern "C" int memlens_install_cuda_hooks(long offset_from_getter) {
  const at::CUDAHooksInterface& current = at::detail::getCUDAHooks();  // constructs the static
  if (current.hasCUDA()) return 1;
  auto* slot = reinterpret_cast<std::unique_ptr<at::CUDAHooksInterface>*>(
      reinterpret_cast<char*>(&at::detail::getCUDAHooks) + offset_from_getter);
  if (slot->get() != &current) return -1;  // the offset does not point at the static: leave it
  (void)slot->release();  // the old hooks may still be referenced: leak, never free
  slot->reset(new at::SimulatedCudaHooks());
  return 0;
}
"""

_loaded = False


class GuardBuildError(MemlensError):
    """The CUDA device guard could not be compiled (no C++ compiler, or no torch headers)."""


def _cache_dir() -> Path:
    """Where the built library is kept: a folder only this user can write, or a fresh private one.

    The file is loaded into the process (``ctypes.CDLL``), so it must never come from a folder
    someone else could have written to: the same ownership rule as the snapshot cache.
    """
    try:
        folder = cache_dir() / "predict"
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        if trusted_folder(os.lstat(folder)) and trusted_folder(os.lstat(folder.parent)):
            return folder
    except (OSError, RuntimeError):  # RuntimeError: no home folder to put it in
        pass
    return Path(tempfile.mkdtemp(prefix="memlens-predict-"))


def _library_path() -> Path:
    key = hashlib.sha256(f"{torch.__version__}|{torch.__file__}|{_SOURCE}".encode()).hexdigest()[:16]
    return _cache_dir() / f"simulated_cuda_guard-{key}.so"


def _build(target: Path) -> None:
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if compiler is None:
        raise GuardBuildError(
            "memlens predict needs a C++ compiler once, to build a 25-line CUDA device guard for "
            "this CPU-only torch (set CXX, or install g++)"
        )
    torch_dir = Path(torch.__file__).parent
    abi = int(torch.compiled_with_cxx11_abi())
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as work:
        source = Path(work) / "guard.cpp"
        source.write_text(_SOURCE)
        output = Path(work) / target.name
        errors = []
        for standard in _CXX_STANDARDS:
            command = [
                compiler, "-O1", f"-std={standard}", "-shared", "-fPIC", f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
                f"-I{torch_dir / 'include'}", str(source), f"-L{torch_dir / 'lib'}", "-lc10", "-ltorch_cpu",
                f"-Wl,-rpath,{torch_dir / 'lib'}", "-o", str(output),
            ]  # fmt: skip
            result = subprocess.run(command, capture_output=True, text=True, check=False)
            if result.returncode == 0:
                os.replace(output, target)  # atomic: concurrent predictions never load a half-written file
                return
            errors.append(f"-std={standard}: " + _first_errors(result.stderr))
        raise GuardBuildError("building the simulated CUDA device guard failed:\n" + "\n".join(errors))


# torch's headers need C++17 up to 2.13 and C++20 from 2.14 on (std::strong_ordering,
# string_view::starts_with); the older standard is tried first, as the releases CI covers it on.
_CXX_STANDARDS = ("c++17", "c++20")


def _first_errors(stderr: str, count: int = 5) -> str:
    """The compiler's first error lines (its warnings about torch's headers fill pages before them)."""
    lines = [line for line in stderr.splitlines() if "error" in line]
    return "\n".join(lines[:count]) or stderr[-2000:]


def ensure_cuda_guard() -> None:
    """Register the simulated CUDA device guard in this process (once; it cannot be removed)."""
    global _loaded
    if _loaded or has_real_cuda_device():
        return
    # Found first: where it is missing, building the library (against headers it may not even
    # compile with) would only bury the reason under a compiler's errors.
    offset = _hooks_offset()
    if offset is None:
        raise _hooks_not_found()
    path = _library_path()
    if not path.exists() or not trusted_file(os.lstat(path)):
        if path.exists():
            path = Path(tempfile.mkdtemp(prefix="memlens-predict-")) / path.name  # never load a foreign file
        _build(path)
    library = ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
    if library.memlens_install_cuda_hooks(ctypes.c_long(offset)) < 0:
        raise _hooks_not_found()
    _loaded = True


def _hooks_not_found() -> GuardBuildError:
    """torch 2.1 keeps its CUDA hooks in a plain pointer, not the function-local static patched
    here, and a stripped libtorch_cpu lists no symbols: either way nothing can be patched."""
    return GuardBuildError(
        f"memlens predict could not find torch {torch.__version__}'s CUDA hooks to stand in for (predict is "
        "tested on torch 2.13 and 2.14; record, triage and the reader on 2.1 too), or this build's "
        "libtorch_cpu is stripped of its symbol table"
    )


def has_real_cuda_device() -> bool:
    """Whether this process sees a real CUDA device. A CUDA build of torch (what ``pip install
    torch`` gives on Linux) on a machine without a GPU has hooks that answer "no device" and a
    guard that calls the CUDA runtime: autograd then fails with "hasPrimaryContext expects a valid
    device index", so there the simulated guard and hooks are installed as on a CPU-only build."""
    if not torch.backends.cuda.is_built():
        return False
    try:
        return torch.cuda.device_count() > 0
    except RuntimeError:  # a driver too old for this build, or a broken install: no usable device
        return False


def check_autograd_sees_cuda() -> None:
    """Fail in one clear line if this process's autograd engine started before the emulated GPU.

    The engine sizes its per-device queues once, the first time ``backward()`` runs in a process;
    if that happened before memlens registered its CUDA device, every later CUDA backward trips
    an internal assertion of PyTorch's. Nothing can resize the queues, so say what to do instead.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    try:
        with FakeTensorMode():
            probe = torch.empty(1, device="cuda", requires_grad=True)
            probe.sum().backward()
    except RuntimeError as exc:
        if "device_ready_queues_" not in str(exc):
            raise
        raise MemlensUsageError(
            "memlens.predict needs a process in which backward() has not run yet (autograd started "
            "before the emulated GPU existed): call it before any training code runs, or use "
            "`memlens predict -- python script.py`"
        ) from None


_GETTER = b"_ZN2at6detail12getCUDAHooksEv"
_HOOKS_STATIC = b"_ZZN2at6detail12getCUDAHooksEvE5hooks"


def _hooks_offset() -> int | None:
    """Distance from ``at::detail::getCUDAHooks`` to its function-local ``hooks`` static, read
    from libtorch_cpu's ELF symbol table (the static is not exported, but it is listed)."""
    library = Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"
    if not library.exists():
        return None
    values = _elf_symbol_values(library, (_GETTER, _HOOKS_STATIC))
    if len(values) != 2:
        return None
    return values[_HOOKS_STATIC] - values[_GETTER]


def _elf_symbol_values(path: Path, names: tuple[bytes, ...]) -> dict[bytes, int]:
    """``st_value`` of each named symbol in a 64-bit little-endian ELF file's ``.symtab``."""
    import mmap

    import numpy as np

    with open(path, "rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as data:
        if data[:6] != b"\x7fELF\x02\x01":
            return {}
        shoff = int.from_bytes(data[0x28:0x30], "little")
        shentsize = int.from_bytes(data[0x3A:0x3C], "little")
        shnum = int.from_bytes(data[0x3C:0x3E], "little")
        sections = []
        for index in range(shnum):
            base = shoff + index * shentsize
            sh_type = int.from_bytes(data[base + 4 : base + 8], "little")
            sh_offset = int.from_bytes(data[base + 24 : base + 32], "little")
            sh_size = int.from_bytes(data[base + 32 : base + 40], "little")
            sh_link = int.from_bytes(data[base + 40 : base + 44], "little")
            sections.append((sh_type, sh_offset, sh_size, sh_link))
        symtabs = [section for section in sections if section[0] == 2]  # SHT_SYMTAB
        if not symtabs:
            return {}
        _, sym_offset, sym_size, strtab_index = symtabs[0]
        _, str_offset, str_size, _ = sections[strtab_index]
        strtab = data[str_offset : str_offset + str_size]
        symbol_type = np.dtype(
            [("name", "<u4"), ("info", "u1"), ("other", "u1"), ("shndx", "<u2"), ("value", "<u8"), ("size", "<u8")]
        )
        symbols = np.frombuffer(data[sym_offset : sym_offset + sym_size], dtype=symbol_type)
        found: dict[bytes, int] = {}
        for name in names:
            start = strtab.find(b"\0" + name + b"\0")
            while start >= 0 and name not in found:
                matches = np.flatnonzero(symbols["name"] == start + 1)
                if len(matches):
                    found[name] = int(symbols["value"][matches[0]])
                start = strtab.find(b"\0" + name + b"\0", start + 1)
        return found


__all__ = ["GuardBuildError", "check_autograd_sees_cuda", "ensure_cuda_guard", "has_real_cuda_device"]
