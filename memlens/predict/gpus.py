"""The GPUs ``memlens predict --gpu`` can stand in for.

``total_memory`` is what ``torch.cuda.get_device_properties(0).total_memory`` reports on that
board: read on an H200; for the others nvidia-smi's total in MiB, which can differ from torch's
figure by a few hundred MiB. It is the capacity the caching allocator can reach before the CUDA
context takes its share; pass ``reserve_outside`` for that share. The compute
capability decides the choices PyTorch makes per device: the default cuBLAS workspace (Hopper
and later use a larger one), whether bf16 is native, which fused attention kernels exist.
"""

from __future__ import annotations

from dataclasses import dataclass

from memlens.errors import MemlensUsageError

MIB = 1 << 20


@dataclass(frozen=True)
class GpuSpec:
    key: str
    name: str
    total_memory: int
    major: int
    minor: int
    multi_processor_count: int
    # Other names people type for this board (besides its key and its marketing name).
    aliases: tuple[str, ...] = ()

    @property
    def capability(self) -> tuple[int, int]:
        return (self.major, self.minor)


GPUS: dict[str, GpuSpec] = {
    spec.key: spec
    for spec in (
        # A bare "H100" / "A100" is the SXM board with the most common memory (what clouds rent).
        GpuSpec("h100-80gb", "NVIDIA H100 80GB HBM3", 81_559 * MIB, 9, 0, 132, ("h100", "h100-sxm", "h100-sxm5")),
        GpuSpec("h100-94gb", "NVIDIA H100 NVL", 95_830 * MIB, 9, 0, 132),
        GpuSpec("h200", "NVIDIA H200", 150_109_880_320, 9, 0, 132, ("h200-141gb",)),  # as torch reported it on one
        GpuSpec("a100-80gb", "NVIDIA A100-SXM4-80GB", 81_920 * MIB, 8, 0, 108, ("a100",)),
        GpuSpec("a100-40gb", "NVIDIA A100-SXM4-40GB", 40_960 * MIB, 8, 0, 108),
        GpuSpec("l40s", "NVIDIA L40S", 46_068 * MIB, 8, 9, 142),
        GpuSpec("l4", "NVIDIA L4", 23_034 * MIB, 8, 9, 58),
        GpuSpec("a10g", "NVIDIA A10G", 23_028 * MIB, 8, 6, 80),
        GpuSpec("rtx4090", "NVIDIA GeForce RTX 4090", 24_564 * MIB, 8, 9, 128, ("4090",)),
        GpuSpec("rtx3090", "NVIDIA GeForce RTX 3090", 24_576 * MIB, 8, 6, 82, ("3090",)),
        GpuSpec("v100-16gb", "Tesla V100-SXM2-16GB", 16_160 * MIB, 7, 0, 80),
        GpuSpec("v100-32gb", "Tesla V100-SXM2-32GB", 32_768 * MIB, 7, 0, 80),
        GpuSpec("t4", "Tesla T4", 15_360 * MIB, 7, 5, 40),
    )
}

DEFAULT_GPU = "a100-80gb"

# Words a name may carry that tell nothing about the board.
_VENDOR_WORDS = ("nvidia", "geforce", "tesla")
GPU_NAMES_HELP = (
    "GPU to simulate (default a100-80gb): " + ", ".join(GPUS) + ". Case-insensitive; a unique prefix or "
    "the marketing name works too (H100 = h100-80gb, A100 = a100-80gb, 'NVIDIA L4', 'RTX 4090')."
)


def _normalized(name: str) -> str:
    """``"NVIDIA H100 80GB HBM3"`` -> ``"h10080gbhbm3"``: lower case, no vendor words, letters and digits only."""
    text = name.lower()
    for word in _VENDOR_WORDS:
        text = text.replace(word, "")
    return "".join(ch for ch in text if ch.isalnum())


def _names_of(spec: GpuSpec) -> set[str]:
    return {_normalized(name) for name in (spec.key, spec.name, *spec.aliases)}


def gpu_spec(name: str) -> GpuSpec:
    """The GPU a user named: its key, its marketing name or an alias, in any case and spelling
    (``H100``, ``h100-80gb``, ``"NVIDIA A100-SXM4-80GB"``, ``rtx-4090``), or a prefix of those
    that only one GPU has (``l40`` is the L40S; ``a10`` is refused: A10G or an A100)."""
    wanted = _normalized(name)
    if wanted:
        exact = [spec for spec in GPUS.values() if wanted in _names_of(spec)]
        if len(exact) == 1:
            return exact[0]
        by_prefix = [spec for spec in GPUS.values() if any(known.startswith(wanted) for known in _names_of(spec))]
        if len(by_prefix) == 1:
            return by_prefix[0]
        if len(by_prefix) > 1:
            raise MemlensUsageError(
                f"GPU {name!r} is ambiguous: it could be {', '.join(spec.key for spec in by_prefix)}"
            )
    raise MemlensUsageError(f"unknown GPU {name!r}; known: {', '.join(GPUS)} (H100 and A100 mean the 80GB boards)")


def with_capacity(spec: GpuSpec, total_memory: int) -> GpuSpec:
    """The same device with another memory size (``--capacity`` next to, or without, ``--gpu``)."""
    return GpuSpec(spec.key, spec.name, total_memory, spec.major, spec.minor, spec.multi_processor_count)


def default_cublas_workspace_bytes(spec: GpuSpec) -> int:
    """The workspace PyTorch gives each cuBLAS handle when ``CUBLAS_WORKSPACE_CONFIG`` is unset:
    ``:4096:2:16:8`` (2 x 4 MiB + 8 x 16 KiB, seen as 8,519,680-byte blocks in the real CS336
    snapshots) before Hopper, ``:4096:8`` (32 MiB, seen on an H200) from Hopper on."""
    if spec.major >= 9:
        return 8 * 4096 * 1024
    return 2 * 4096 * 1024 + 8 * 16 * 1024


def cublas_workspace_bytes(spec: GpuSpec, config: str | None) -> int:
    """The size ``CUBLAS_WORKSPACE_CONFIG`` (``:SIZE_KiB:COUNT`` pairs) asks for, else the default."""
    if not config:
        return default_cublas_workspace_bytes(spec)
    numbers = [part for part in config.split(":") if part]
    try:
        values = [int(part) for part in numbers]
    except ValueError:
        return default_cublas_workspace_bytes(spec)
    if len(values) % 2:
        return default_cublas_workspace_bytes(spec)
    return sum(size_kib * 1024 * count for size_kib, count in zip(values[::2], values[1::2], strict=True))


__all__ = [
    "DEFAULT_GPU",
    "GPUS",
    "GPU_NAMES_HELP",
    "GpuSpec",
    "cublas_workspace_bytes",
    "default_cublas_workspace_bytes",
    "gpu_spec",
    "with_capacity",
]
