"""The sidecar's format (``run.memlens.json`` beside ``run.pickle``): one typed, versioned
contract between the writer (``memlens.sidecar.writer``) and every reader (``memlens.sidecar.reader``).

``Sidecar`` is what the recorder (and ``memlens predict``) writes and what the analysis, the
budget, the fleet, the dashboard and the MCP server read: attributes, never key lookups. The
holders of a leak are a part of their own (``memlens.sidecar.leak_holders``), read tolerantly.

Layouts (``memlens_sidecar_version``):

- none: what the analysis once accepted from sidecars it did not write (test fixtures, other
  tools): the device's memory as ``total_memory``/``capacity_bytes``/``capacity``/
  ``total_memory_bytes`` at the top level, under ``device``, ``devices[index]`` or ``model``; the
  parameter count as ``trainable_parameters``/``parameters``/``parameter_count``/
  ``num_parameters``; the shapes as ``hidden``/``heads``/``batch``/``micro_batch_size``/
  ``sequence_length``/``seq_length``/``seq`` under ``model``, ``model.config``, ``model.inputs``
  or a top-level ``inputs``. Each moves to its one place below.
- 1: the recorder until this layout: ``model.config`` held the dimensions under the names the
  model declared them by (``d_model``, ``n_embd``, ``n_heads``, ``n_head``, ``n_kv_heads``, or the
  Hugging Face names), and ``memlens predict`` wrote ``device.compute_capability`` as ``[8, 0]``.
  They become the Hugging Face names and ``"8.0"``.
- 2 (``SIDECAR_VERSION``): this module's structs. ``model.config`` adds ``num_layers`` (a config's
  layer count, else the length of the model's largest ``nn.ModuleList`` of blocks, found at run
  time: ``layers_module`` names it), ``vocab_size`` and ``intermediate_size``; ``model`` adds
  ``autocast_dtype`` (what autocast cast to during the model's first forward); ``optimizer``
  adds ``state_dtype`` (the dtype of most of its state at the dump).

Every count is a non-negative integer below 2**56 and every text is bounded: a hostile sidecar
is refused whole, with the first field that does not fit (``Expected `int`, got `str` - at
`$.model.parameters_total```); the snapshot beside it is still read, without it.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

from memlens.sidecar.leak_holders import LeakHolders

SIDECAR_VERSION = 2
SIDECAR_SUFFIX = ".memlens.json"
SIDECAR_MAX_INT = 1 << 56
MAX_TEXT = 4096

Count = Annotated[int, msgspec.Meta(ge=0, le=SIDECAR_MAX_INT)]
Dimension = Annotated[int, msgspec.Meta(ge=1, le=SIDECAR_MAX_INT)]
Text = Annotated[str, msgspec.Meta(max_length=MAX_TEXT)]
# Addresses and times go into the analysis' int64 columns.
Int64 = Annotated[int, msgspec.Meta(ge=-(1 << 63), le=(1 << 63) - 1)]


class _Part(msgspec.Struct, kw_only=True):
    """A part of the sidecar; unknown keys are ignored (a newer writer may add some)."""


class DeviceInfo(_Part):
    """The device recorded on. ``total_memory_bytes``: its memory (the simulated capacity on
    the CPU recorder; ``None`` = unlimited or unknown)."""

    type: Text | None = None
    index: Count | None = None
    name: Text | None = None
    total_memory_bytes: Count | None = None
    simulated: bool = False
    compute_capability: Text | None = None  # "8.0" on CUDA


class RecordedStep(_Part):
    """A recorded step on the trace's clock; ``end_us`` None for a step still open at the dump."""

    index: Count
    start_us: Int64 | None = None
    end_us: Int64 | None = None


class OutOfMemory(_Part):
    requested_bytes: Count = 0
    device_free_bytes: Count = 0


class ModelConfig(_Part):
    """The dimensions the model declares (Hugging Face names), and its layer count."""

    hidden_size: Dimension | None = None
    num_attention_heads: Dimension | None = None
    num_key_value_heads: Dimension | None = None
    num_layers: Dimension | None = None
    # Where ``num_layers`` was counted: None when the config declares it, else the dotted name of
    # the module list of blocks ("transformer.h", "blocks").
    layers_module: Text | None = None
    vocab_size: Dimension | None = None
    intermediate_size: Dimension | None = None


class ModelInputs(_Part):
    """The model's first forward call: token ids ``(batch, seq)`` or a ``(batch, seq, hidden)`` input."""

    batch_size: Dimension
    seq_len: Dimension
    shape: list[Count] = msgspec.field(default_factory=list)
    dtype: Text | None = None


class ModelInfo(_Part):
    """A watched model's parameters (``source`` "model"), or an optimizer's when no one module
    owns them (``source`` "optimizer", ``buffer_bytes_total`` None)."""

    parameters_total: Count | None = None
    parameters_trainable: Count | None = None
    parameter_bytes_total: Count | None = None
    parameter_bytes_by_dtype: dict[Text, Count] = msgspec.field(default_factory=dict)
    buffer_bytes_total: Count | None = None
    source: Text | None = None
    config: ModelConfig = msgspec.field(default_factory=ModelConfig)
    inputs: ModelInputs | None = None
    autocast_dtype: Text | None = None  # "torch.bfloat16"; None: autocast off, or not known

    @property
    def main_dtype(self) -> str | None:
        """The dtype holding most of the parameter bytes ("torch.float32"), None when not known."""
        by_dtype = self.parameter_bytes_by_dtype
        return max(sorted(by_dtype), key=lambda name: by_dtype[name]) if by_dtype else None


class OptimizerInfo(_Part):
    class_name: Text | None = msgspec.field(default=None, name="class")  # "AdamW"
    param_groups: Count | None = None
    momentum: Annotated[float, msgspec.Meta(ge=0)] | None = None  # SGD's, where it has one
    state_dtype: Text | None = None  # "torch.float32": most of its state at the dump; None before a step


class RecorderSettings(_Part):
    stacks: Text | bool | None = None
    context: Text | None = None
    max_entries: Count | None = None
    max_stack_depth: Count | None = None
    dump_every: Count | None = None
    module_scopes: bool | Count | None = None
    predict: bool = False


class RoleRecord(_Part, omit_defaults=True):
    """Storages first seen at one moment, by role: flat ``[address, nbytes, ...]`` lists
    (``memlens.recorder.roles``). ``time_us`` None: at the dump, the end of the trace. The
    moment is always written; roles with nothing new are left out of the file."""

    time_us: Int64 | None
    at: Text
    device: Count
    parameters: list[Int64] = msgspec.field(default_factory=list)
    buffers: list[Int64] = msgspec.field(default_factory=list)
    gradients: list[Int64] = msgspec.field(default_factory=list)
    optimizer_state: list[Int64] = msgspec.field(default_factory=list)
    inputs: list[Int64] = msgspec.field(default_factory=list)
    outputs: list[Int64] = msgspec.field(default_factory=list)
    graph: list[Int64] = msgspec.field(default_factory=list)


class TensorRoles(_Part):
    version: int = 1
    records: list[RoleRecord] = msgspec.field(default_factory=list)


class OutsideReading(_Part):
    """At a step boundary on CUDA: ``mem_get_info``'s used bytes against PyTorch's reserved."""

    at: Text = ""
    time_us: Int64 | None = None
    device: Count = 0
    device_used_bytes: Count | None = None
    reserved_bytes: Count | None = None
    outside_pytorch_bytes: Count | None = None


class Sidecar(_Part):
    """What the recorder knew about the run (see the module docstring for the layouts)."""

    memlens_sidecar_version: int = SIDECAR_VERSION
    memlens_version: Text | None = None
    backend: Text | None = None  # "cuda" or "cpu" (the CPU recorder's simulated allocator)
    reason: Text | None = None  # why the dump happened: exit, exception, oom, periodic, ...
    torch_version: Text | None = None
    python_version: Text | None = None
    device: DeviceInfo = msgspec.field(default_factory=DeviceInfo)
    allocator_settings: dict[Text, Any] = msgspec.field(default_factory=dict)
    rank: Count | None = None
    world_size: Count | None = None
    local_rank: Count | None = None
    steps: list[RecordedStep] = msgspec.field(default_factory=list)
    steps_selected: list[Count] | None = None
    peak_allocated_bytes: Count | None = None
    peak_reserved_bytes: Count | None = None
    oom: OutOfMemory | None = None
    model: ModelInfo | None = None
    optimizer: OptimizerInfo | None = None
    recorder: RecorderSettings | None = None
    tensor_roles: TensorRoles | None = None
    outside_pytorch: list[OutsideReading] | None = None
    # The objects the recorder found holding a leak's tensors (``memlens.recorder.holders``).
    # Read by ``read_leak_holders`` (one holder of the wrong shape is skipped, not the sidecar):
    # see ``memlens.sidecar.reader.sidecar_from_builtins``.
    leak_holders: LeakHolders | None = None

    @property
    def capacity_bytes(self) -> int | None:
        """The device's memory, when the sidecar states a positive one."""
        return self.device.total_memory_bytes or None

    @property
    def trainable_parameters(self) -> int | None:
        """The model's trainable parameter count, when the sidecar states a positive one."""
        return (self.model.parameters_trainable or None) if self.model is not None else None


__all__ = [
    "SIDECAR_SUFFIX",
    "SIDECAR_VERSION",
    "DeviceInfo",
    "ModelConfig",
    "ModelInfo",
    "ModelInputs",
    "OptimizerInfo",
    "OutOfMemory",
    "OutsideReading",
    "RecordedStep",
    "RecorderSettings",
    "RoleRecord",
    "Sidecar",
    "TensorRoles",
]
