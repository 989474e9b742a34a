"""The GPUs ``memlens predict --gpu`` can stand in for.

``total_memory`` is the capacity PyTorch reports on that board: its out-of-memory message's
"GPU 0 has a total capacity of 14.56 GiB", i.e. ``torch.cuda.get_device_properties(0).total_memory``,
which is smaller than nvidia-smi's MiB total (the driver keeps a share). Where drivers report
different figures for one board, the smaller is kept, so a run is never told it fits by a margin a
newer driver takes away. Each figure names its public source beside it; "estimated" marks the
boards for which none was found. A figure printed to two decimals is taken at the least it can be
(``printed_gib``). It is the capacity the caching allocator can reach before the CUDA context and
library handles (cuBLAS, NCCL) take their share outside it; pass ``reserve_outside`` for that
share. The compute capability decides the choices PyTorch makes per device: the default cuBLAS
workspace (Hopper and later use a larger one), whether bf16 is native, which fused attention
kernels exist.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from memlens.errors import MemlensUsageError
from memlens.units import format_bytes

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
    # Where ``total_memory`` comes from: a public message of torch's on that board, or "estimated".
    source: str = "estimated"

    @property
    def capability(self) -> tuple[int, int]:
        return (self.major, self.minor)

    @property
    def source_kind(self) -> str:
        """``published`` (a message of torch's on that board, cited), ``measured``, ``estimated``
        or ``--capacity`` (the user's figure)."""
        for kind in ("estimated", "measured", CAPACITY_GIVEN):
            if self.source.startswith(kind):
                return kind
        return "published"


def printed_gib(figure: float) -> int:
    """The least capacity torch prints as ``figure`` GiB ("14.56 GiB" is 14.555 GiB or more): an
    OOM message's figure taken so that a board is never thought larger than it can be."""
    return math.ceil((figure - 0.005) * (1 << 30))


GPUS: dict[str, GpuSpec] = {
    spec.key: spec
    for spec in (
        # A bare "H100" / "A100" is the SXM board with the most common memory (what clouds rent).
        GpuSpec("h100-80gb", "NVIDIA H100 80GB HBM3", printed_gib(79.10), 9, 0, 132, ("h100", "h100-sxm", "h100-sxm5"),
                "estimated: OOM messages on H100 80GB boards print 79.10 to 79.19 GiB (issue 32); the "
                "smaller kept; nvidia-smi says 81,559 MiB"),
        GpuSpec("h100-94gb", "NVIDIA H100 NVL", printed_gib(93.03), 9, 0, 132, (),
                "estimated: nvidia-smi's 95,830 MiB less the 0.55 GiB the H100 80GB's driver keeps"),
        GpuSpec("h200", "NVIDIA H200", 150_109_880_320, 9, 0, 132, ("h200-141gb",),
                "measured by memlens on 2026-12-04, torch 2.11.0+cu130, driver 580.159.04: "
                "torch.cuda.get_device_properties(0).total_memory 150,109,880,320 bytes, its OOM message "
                "'GPU 0 has a total capacity of 139.80 GiB'; nvidia-smi 143,771 MiB (tests/data/h200/extra.txt)"),
        GpuSpec("a100-80gb", "NVIDIA A100-SXM4-80GB", printed_gib(79.14), 8, 0, 108, ("a100",),
                "torch OOM message 'total capacity of 79.14 GiB' on an A100 80GB, "
                "https://github.com/lianqi1008/Control-GIC/issues/6 (79.25 GiB on older drivers, "
                "https://github.com/levihsu/OOTDiffusion/issues/235)"),
        GpuSpec("a100-40gb", "NVIDIA A100-SXM4-40GB", 42_298_834_944, 8, 0, 108, (),
                "CUDA deviceQuery 'NVIDIA A100-SXM4-40GB ... 40339 MBytes (42298834944 bytes)', "
                "https://github.com/bottlerocket-os/bottlerocket/pull/3873 (torch has printed 39.50 GiB, "
                "https://github.com/TianheWu/CoSeR/issues/10)"),
        GpuSpec("l40s", "NVIDIA L40S", printed_gib(44.40), 8, 9, 142, (),
                "estimated: the L40's figure (the same 48 GB of GDDR6 and nvidia-smi's 46,068 MiB), "
                "torch OOM message 'total capacity of 44.40 GiB', https://github.com/NVlabs/Eagle/issues/68"),
        GpuSpec("l4", "NVIDIA L4", printed_gib(22.03), 8, 9, 58, (),
                "estimated: ~22.03 GiB as torch reports it (issue 32); nvidia-smi says 23,034 MiB"),
        GpuSpec("a10g", "NVIDIA A10G", printed_gib(21.99), 8, 6, 80, (),
                "estimated: ~21.99 GiB as torch reports it (issue 32; 'A10G reports ~22GB', "
                "https://github.com/huggingface/local-gemma/pull/25); nvidia-smi says 23,028 MiB"),
        GpuSpec("rtx4090", "NVIDIA GeForce RTX 4090", printed_gib(23.64), 8, 9, 128, ("4090",),
                "torch OOM message 'total capacity of 23.64 GiB' on an RTX 4090, "
                "https://github.com/ali-vilab/VGen/issues/104 (23.65 GiB on others, "
                "https://github.com/MotrixLab/AiOS/issues/29)"),
        GpuSpec("rtx3090", "NVIDIA GeForce RTX 3090", printed_gib(23.69), 8, 6, 82, ("3090",),
                "estimated: nvidia-smi's 24,576 MiB less the 0.31 GiB the RTX 4090's driver keeps"),
        GpuSpec("v100-16gb", "Tesla V100-SXM2-16GB", printed_gib(15.75), 7, 0, 80, (),
                "estimated: torch has printed 'total capacity 15.75 GiB' for 16 GB boards "
                "(https://github.com/Morizeyao/GPT2-Chinese/issues/215; the board is not named there)"),
        GpuSpec("v100-32gb", "Tesla V100-SXM2-32GB", printed_gib(31.75), 7, 0, 80, (),
                "estimated: torch has printed '31.75 GiB total capacity' for 32 GB boards "
                "(https://github.com/hiyouga/LlamaFactory/issues/182; the board is not named there)"),
        GpuSpec("t4", "Tesla T4", printed_gib(14.56), 7, 5, 40, (),
                "torch OOM message 'total capacity of 14.56 GiB' on a Tesla T4, "
                "https://github.com/Zheng-Chong/CatVTON/issues/133 and "
                "https://github.com/AlphaGPU/leetgpu-challenges/issues/52 (14.75 GiB on older drivers, "
                "https://github.com/hpcaitech/Open-Sora/issues/697)"),
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
    return GpuSpec(spec.key, spec.name, total_memory, spec.major, spec.minor, spec.multi_processor_count,
                   spec.aliases, CAPACITY_GIVEN)


# ``GpuSpec.source`` of a board whose memory the user gave (``--capacity``).
CAPACITY_GIVEN = "--capacity"


def checked_reserve(spec: GpuSpec, reserve_outside: int) -> int:
    """``reserve_outside`` if it leaves the allocator some of the board, else a usage error in
    the user's units ("--reserve-outside 100.00 GiB is more than the 79.14 GiB board")."""
    if reserve_outside < 0:
        raise MemlensUsageError(f"--reserve-outside {format_bytes(reserve_outside)}: it cannot be negative")
    if reserve_outside >= spec.total_memory:
        what = "the --capacity" if spec.source == CAPACITY_GIVEN else f"the {spec.name}'s"
        raise MemlensUsageError(
            f"--reserve-outside {format_bytes(reserve_outside)} is more than {what} "
            f"{format_bytes(spec.total_memory)}: it would leave PyTorch's allocator nothing"
        )
    return reserve_outside


@dataclass(frozen=True)
class FitBasis:
    """What a prediction's "fits" was decided against, for the user to check: the board's memory
    and where that figure comes from, what ``--reserve-outside`` took, what is left for PyTorch's
    allocator, and the per-board behaviour kept (the cuBLAS workspace each handle allocates inside
    the allocator, the compute capability)."""

    board: GpuSpec
    board_named: bool  # --gpu given (else the default board's behaviour stands behind --capacity)
    reserve_outside_bytes: int
    workspace_bytes: int

    @property
    def allocator_bytes(self) -> int:
        return self.board.total_memory - self.reserve_outside_bytes

    def lines(self) -> list[str]:
        board = self.board
        given = board.source == CAPACITY_GIVEN
        capacity = (f"--capacity {format_bytes(board.total_memory)}" if given else
                    f"{format_bytes(board.total_memory)} (the {board.key} as torch reports it, {board.source_kind})")
        lines = [f"fit decided against {capacity} - {format_bytes(self.reserve_outside_bytes)} --reserve-outside"
                 f" = {format_bytes(self.allocator_bytes)} for PyTorch's allocator"]
        behaviour = (f"compute capability {board.major}.{board.minor}, cuBLAS workspace "
                     f"{format_bytes(self.workspace_bytes)}")
        if given and not self.board_named:
            lines.append(f"--capacity without --gpu keeps the {board.key}'s behaviour: {behaviour}")
        else:
            lines.append(f"board behaviour ({board.key}): {behaviour}, inside the allocator")
        lines.append("outside the allocator, counted only in --reserve-outside: the CUDA context "
                     "(often 0.3-0.6 GiB), NCCL, other processes")
        return lines


def fit_basis(gpu: str | GpuSpec | None, capacity: int | None, reserve_outside: int,
              workspace_config: str | None = None) -> FitBasis:
    """The ``FitBasis`` of a prediction asked for with these options (``--gpu``, ``--capacity``,
    ``--reserve-outside``, ``CUBLAS_WORKSPACE_CONFIG``)."""
    named = gpu is not None
    spec = gpu if isinstance(gpu, GpuSpec) else gpu_spec(gpu or DEFAULT_GPU)
    if capacity is not None:
        spec = with_capacity(spec, capacity)
    return FitBasis(spec, named, checked_reserve(spec, reserve_outside), cublas_workspace_bytes(spec, workspace_config))


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
    "CAPACITY_GIVEN",
    "DEFAULT_GPU",
    "GPUS",
    "GPU_NAMES_HELP",
    "FitBasis",
    "GpuSpec",
    "checked_reserve",
    "cublas_workspace_bytes",
    "default_cublas_workspace_bytes",
    "fit_basis",
    "gpu_spec",
    "printed_gib",
    "with_capacity",
]
