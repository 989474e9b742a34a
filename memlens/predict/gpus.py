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

    @property
    def capability(self) -> tuple[int, int]:
        return (self.major, self.minor)


GPUS: dict[str, GpuSpec] = {
    spec.key: spec
    for spec in (
        GpuSpec("h100-80gb", "NVIDIA H100 80GB HBM3", 81_559 * MIB, 9, 0, 132),
        GpuSpec("h100-94gb", "NVIDIA H100 NVL", 95_830 * MIB, 9, 0, 132),
        GpuSpec("h200", "NVIDIA H200", 150_109_880_320, 9, 0, 132),  # as torch reported it on one
        GpuSpec("a100-80gb", "NVIDIA A100-SXM4-80GB", 81_920 * MIB, 8, 0, 108),
        GpuSpec("a100-40gb", "NVIDIA A100-SXM4-40GB", 40_960 * MIB, 8, 0, 108),
        GpuSpec("l40s", "NVIDIA L40S", 46_068 * MIB, 8, 9, 142),
        GpuSpec("l4", "NVIDIA L4", 23_034 * MIB, 8, 9, 58),
        GpuSpec("a10g", "NVIDIA A10G", 23_028 * MIB, 8, 6, 80),
        GpuSpec("rtx4090", "NVIDIA GeForce RTX 4090", 24_564 * MIB, 8, 9, 128),
        GpuSpec("rtx3090", "NVIDIA GeForce RTX 3090", 24_576 * MIB, 8, 6, 82),
        GpuSpec("v100-16gb", "Tesla V100-SXM2-16GB", 16_160 * MIB, 7, 0, 80),
        GpuSpec("v100-32gb", "Tesla V100-SXM2-32GB", 32_768 * MIB, 7, 0, 80),
        GpuSpec("t4", "Tesla T4", 15_360 * MIB, 7, 5, 40),
    )
}

DEFAULT_GPU = "a100-80gb"


def gpu_spec(key: str) -> GpuSpec:
    spec = GPUS.get(key.lower())
    if spec is None:
        raise MemlensUsageError(f"unknown GPU {key!r}; known: {', '.join(sorted(GPUS))}")
    return spec


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
    "GpuSpec",
    "cublas_workspace_bytes",
    "default_cublas_workspace_bytes",
    "gpu_spec",
    "with_capacity",
]
