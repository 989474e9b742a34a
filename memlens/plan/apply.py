"""The levers, applied from outside the user's script, inside the predicted run.

Hooks are installed before the script runs, as predict intercepts CUDA: the model is found when
the script moves a module holding an ``nn.ModuleList`` to CUDA (``Module.to``/``.cuda``, before
the move, as ``get_peft_model(model).cuda()`` would be), else when it builds an optimizer (the
module owning its parameters), else at the model's first forward call. There the module levers
are applied once (checkpointing, LoRA, QLoRA); the optimizer levers replace the classes
``torch.optim`` exports, so the script's own ``torch.optim.AdamW(...)`` builds the replacement.

What each lever found (the blocks, the adapters, the optimizer replaced) is kept in ``notes``,
which the plan shows next to the figures and turns into the code change it recommends.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn

from memlens.errors import MemlensUsageError
from memlens.plan.ddp import install_ddp_support
from memlens.plan.deepspeed import install_deepspeed_support
from memlens.plan.levers import Lever, value_of
from memlens.plan.meshes import install_mesh_support

# The ops selective checkpointing keeps (the expensive ones, as torchtitan's policy does):
# matrix multiplies and attention; every other op of a block is recomputed in backward.
_aten = torch.ops.aten
SAC_SAVED_OPS = frozenset(
    getattr(_aten, name).default
    for name in (
        "mm",
        "addmm",
        "bmm",
        "baddbmm",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
    )
    if hasattr(_aten, name)
)

# bitsandbytes' layouts (bitsandbytes/optim/optimizer.py, bitsandbytes/functional.py).
BNB_MIN_8BIT_SIZE = 4096  # smaller tensors keep 32-bit state
BNB_OPTIMIZER_BLOCK = 256  # block-wise 8-bit state: one fp32 absmax per 256 values
BNB_PAGED_MIN_SIZE = 100_000  # paged (managed-memory) buffers only from this size on
NF4_BLOCK = 64  # 4-bit weights: one absmax per 64 values
NF4_NESTED_BLOCK = 256  # double quantization: the absmaxes quantized in blocks of 256
LORA_ALPHA = 8  # peft's LoraConfig default


def _lora_targets(levers: tuple[Lever, ...]) -> list[str] | None:
    value = value_of(levers, "lora-targets")
    return value.split(",") if value else None


class LeverHooks:
    """Install with ``install()`` before the script runs; ``notes`` says what was applied."""

    def __init__(self, levers: tuple[Lever, ...]) -> None:
        self.levers = levers
        self.notes: dict[str, Any] = {}
        self._applied: list[nn.Module] = []
        self._saved: list[tuple[Any, str, Any]] = []
        self._forward_hook: Any = None
        self.offload_params = value_of(levers, "offload") == "params"
        self.module_levers = [
            lever for lever in levers if lever.name in ("ckpt", "sac", "lora", "qlora", "fsdp") or self.offload_params
        ]
        self.world_size = 1
        self._pending_shard: tuple[nn.Module, list[nn.Module]] | None = None

    # ------------------------------------------------------------------ install
    def install(self) -> None:
        if self.module_levers:
            self._patch(nn.Module, "to", self._before_move(nn.Module.to, to_call=True))
            self._patch(nn.Module, "cuda", self._before_move(nn.Module.cuda, to_call=False))
            self._forward_hook = nn.modules.module.register_module_forward_pre_hook(self._on_forward)
        optimizer = value_of(self.levers, "optim")
        offload = value_of(self.levers, "offload")
        offload = offload if offload == "optimizer" else None  # params: FSDP2's CPU offload
        if optimizer or offload or self.module_levers:
            self._patch(torch.optim.Optimizer, "__init__", self._on_optimizer_init(torch.optim.Optimizer.__init__))
        if optimizer or offload:
            for name in _OPTIMIZER_NAMES:
                original = getattr(torch.optim, name, None)
                if isinstance(original, type):
                    _ORIGINALS[name] = original
                    self._patch(torch.optim, name, _replacing_optimizer(original, optimizer, offload, self.notes))

    def unapplied(self) -> list[str]:
        """The levers asked for that found nothing to act on: the run is then not what its
        label says, and is reported so (never shown as if the lever had been pulled)."""
        missing = []
        if self.module_levers and not self._applied:
            names = sorted({lever.text() for lever in self.module_levers})
            missing.append(
                f"{'+'.join(names)}: the model holds no nn.ModuleList of blocks (these levers act on its largest)"
            )
        missing += self.notes.get("unmatched", [])
        replaced_optimizer = value_of(self.levers, "optim") or value_of(self.levers, "offload") == "optimizer"
        if replaced_optimizer and "optimizer_replaced" not in self.notes:
            missing.append("optim/offload: the script built no torch.optim optimizer to replace")
        return missing

    def final_notes(self) -> dict[str, Any]:
        """``notes``, with the bytes paged optimizers keep outside PyTorch's allocator."""
        if _PAGED:
            self.notes["paged_optimizer_bytes"] = sum(optimizer.paged_bytes for optimizer in _PAGED)
        return self.notes

    def uninstall(self) -> None:
        if self._forward_hook is not None:
            self._forward_hook.remove()
        for owner, name, value in reversed(self._saved):
            setattr(owner, name, value)
        self._saved.clear()

    def _patch(self, owner: Any, name: str, value: Any) -> None:
        self._saved.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    # ------------------------------------------------------------------ finding the model
    def _before_move(self, original: Callable[..., Any], to_call: bool) -> Callable[..., Any]:
        hooks = self

        @functools.wraps(original)
        def moved(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
            if to_call:
                device = torch._C._nn._parse_to(*args, **kwargs)[0]
                to_cuda = device is not None and torch.device(device).type == "cuda"
            else:
                to_cuda = True
            if to_cuda:
                hooks.offer(module, "to(cuda)")
            moved_module = original(module, *args, **kwargs)
            pending = hooks._pending_shard
            if pending is not None and pending[0] is module:
                hooks._pending_shard = None
                shard_fully(*pending, hooks.world_size, hooks.notes, offload=hooks.offload_params)
            return moved_module

        return moved

    def _on_optimizer_init(self, original: Callable[..., Any]) -> Callable[..., Any]:
        hooks = self

        @functools.wraps(original)
        def init(optimizer: Any, params: Any, *args: Any, **kwargs: Any) -> None:
            original(optimizer, params, *args, **kwargs)
            if hooks.module_levers and not hooks._applied:
                from memlens.recorder.roles import find_model

                model = find_model(optimizer)
                before = dict(model.named_parameters()) if model is not None else {}
                if model is not None and hooks.offer(model, "optimizer"):
                    # Sharding replaced the parameters (FSDP2's DTensors): the optimizer takes
                    # the new ones, as when it is built after fully_shard.
                    after = dict(model.named_parameters())
                    replacement = {id(p): after.get(name, p) for name, p in before.items()}
                    for group in optimizer.param_groups:
                        group["params"] = [replacement.get(id(p), p) for p in group["params"]]
                    adapters = [p for p in model.parameters() if p.requires_grad]
                    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
                    fresh = [p for p in adapters if id(p) not in held]
                    if fresh:
                        optimizer.add_param_group({"params": fresh})

        return init

    def _on_forward(self, module: nn.Module, args: Any) -> None:
        if not self._applied:
            self.offer(module, "forward")
        if self._applied and self._forward_hook is not None:  # found: no hook on every call after
            self._forward_hook.remove()
            self._forward_hook = None

    def offer(self, module: nn.Module, at: str) -> bool:
        """Apply the module levers to ``module`` if it is the model (it holds an nn.ModuleList)
        and no model got them yet; True if they were applied now."""
        if self._applied or any(m is module for m in self._applied):
            return False
        found = largest_module_list(module)
        if found is None:
            return False
        self._applied.append(module)
        path, blocks = found
        self.notes["model_class"] = type(module).__name__
        self.notes["hf_model"] = any(c.__name__ == "PreTrainedModel" for c in type(module).__mro__)
        self.notes["blocks"] = {
            "path": path,
            "class": type(blocks[0]).__name__,
            "count": len(blocks),
            "parameters": sum(p.numel() for b in blocks for p in b.parameters()),
        }
        self.notes["applied_at"] = at
        self.notes["model_parameters"] = sum(p.numel() for p in module.parameters())
        rank = value_of(self.levers, "qlora")
        if rank:
            quantize_nf4(module, blocks, self.notes)
        rank = rank or value_of(self.levers, "lora")
        if rank:
            add_lora(
                module,
                blocks,
                int(rank),
                _lora_targets(self.levers),
                self.notes,
                use_peft=not value_of(self.levers, "qlora"),
            )
        if value_of(self.levers, "ckpt") is not None:
            for block in blocks:
                checkpoint_forward(block, selective=False)
        if value_of(self.levers, "sac") is not None:
            for block in blocks:
                checkpoint_forward(block, selective=True)
        if value_of(self.levers, "fsdp") is not None or self.offload_params:
            if at == "to(cuda)":  # FSDP2 shards parameters already on the device: after the move
                self._pending_shard = (module, blocks)
            else:
                shard_fully(module, blocks, self.world_size, self.notes, offload=self.offload_params)
        return True


# The optimizer classes as torch exports them, while the stand-ins take their names.
_ORIGINALS: dict[str, type] = {}
_PAGED: list[AdamW8bitLayout] = []

_OPTIMIZER_NAMES = ("Adam", "AdamW", "SGD", "Adagrad", "Adadelta", "Adamax", "NAdam", "RAdam", "RMSprop", "Adafactor")


def largest_module_list(model: nn.Module) -> tuple[str, list[nn.Module]] | None:
    """The model's ``nn.ModuleList`` holding the most parameters (the repeated blocks), with its
    dotted path; None when it has none."""
    best: tuple[int, str, list[nn.Module]] | None = None
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) > 0:
            size = sum(p.numel() for p in module.parameters())
            if best is None or size > best[0]:
                best = (size, name, list(module))
    return None if best is None else (best[1], best[2])


# ---------------------------------------------------------------------- distributed
def install_fake_distributed(world_size: int, rank: int = 0) -> Callable[[], None]:
    """This process as rank ``rank`` of ``world_size`` under PyTorch's fake process group
    (``torch.testing._internal.distributed.fake_pg``: collectives return at once, outputs
    sized as the real ones): the script's ``init_process_group`` joins it whatever backend it
    names, the launcher's variables are set (RANK, and the mesh's coordinates, are ``rank``'s);
    DDP's reducer gets what it needs of one rank
    (``memlens.plan.ddp``: its ``collective_op_hook`` goes in the session's ``op_hooks``).
    Returns the undo."""
    import os

    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d
    from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily
    from torch.distributed.device_mesh import DeviceMesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    saved: list[tuple[Any, str, Any]] = []
    if not 0 <= rank < world_size:
        raise MemlensUsageError(f"rank {rank} of {world_size}: a rank is 0 to {world_size - 1}")
    # LOCAL_RANK is 0 whatever the rank: the emulated GPU is the one simulated device, device 0
    # (autograd's engine has a queue for it alone), so a script's cuda:LOCAL_RANK is it.
    environment = {"WORLD_SIZE": str(world_size), "RANK": str(rank), "LOCAL_RANK": "0",
                   "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}  # fmt: skip
    previous_environment = {key: os.environ.get(key) for key in environment}
    os.environ.update(environment)
    original_init = c10d.init_process_group

    def init_process_group(*args: Any, **kwargs: Any) -> None:
        for key in ("backend", "init_method", "store", "world_size", "rank", "device_id"):
            kwargs.pop(key, None)
        original_init("fake", store=FakeStore(), rank=rank, world_size=world_size, **kwargs)

    original_mesh_init = DeviceMesh.__init__

    def real_rank_map(value: Any) -> Any:
        # init_device_mesh builds its identity rank map with torch.arange: inside predict that is
        # a fake (value-less) CPU tensor, and the mesh reads the rank's coordinates from it.
        if isinstance(value, FakeTensor):
            return torch.arange(value.numel(), dtype=value.dtype).view(tuple(value.shape))
        return value

    @functools.wraps(original_mesh_init)
    def mesh_init(self: Any, *args: Any, **kwargs: Any) -> None:
        with unset_fake_temporarily():
            args = tuple(real_rank_map(a) for a in args)
            kwargs = {key: real_rank_map(value) for key, value in kwargs.items()}
            original_mesh_init(self, *args, **kwargs)

    for owner, name, value in ((dist, "init_process_group", init_process_group),
                               (c10d, "init_process_group", init_process_group),
                               (DeviceMesh, "__init__", mesh_init)):  # fmt: skip
        saved.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)
    install_mesh_support(init_process_group, saved)  # a mesh made before any group
    install_deepspeed_support(saved, PLACEHOLDER_VALUES)  # ZeRO's initialize and step, when installed
    undo_ddp = install_ddp_support()

    def undo() -> None:
        undo_ddp()
        for owner, name, value in reversed(saved):
            setattr(owner, name, value)
        for key, value in previous_environment.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value

    return undo


@contextlib.contextmanager
def rank_zero_of(world_size: int, op_hooks: list[Callable[..., Any]]) -> Iterator[None]:
    """This process as rank 0 of ``world_size`` while a predicted run lasts, as the rank 0 torchrun
    starts is: the fake process group (``install_fake_distributed``) and DDP's collectives answered
    on the emulated device (``collective_op_hook``, put in the session's ``op_hooks``)."""
    from memlens.plan.ddp import collective_op_hook

    undo = install_fake_distributed(world_size)
    op_hooks.append(collective_op_hook)
    try:
        yield
    finally:
        op_hooks.remove(collective_op_hook)
        undo()


def shard_fully(
    model: nn.Module, blocks: list[nn.Module], world_size: int, notes: dict[str, Any], offload: bool = False
) -> None:
    """FSDP2: ``fully_shard`` each block, then the root, over all ``world_size`` ranks (the
    fake process group's); ``offload``: with ``CPUOffloadPolicy`` (the shards, their gradients
    and the optimizer step on the CPU; each block's parameters brought to the GPU for its
    forward and backward)."""
    import torch.distributed as dist
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    if not dist.is_initialized():
        dist.init_process_group("fake", world_size=world_size)
    extra: dict[str, Any] = {"offload_policy": CPUOffloadPolicy(pin_memory=False)} if offload else {}
    for block in blocks:
        fully_shard(block, **extra)
    fully_shard(model, **extra)
    notes["fsdp"] = {"world_size": dist.get_world_size(), "units": len(blocks) + 1, "cpu_offload": offload}


# ---------------------------------------------------------------------- checkpointing
def _sac_policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> Any:
    from torch.utils.checkpoint import CheckpointPolicy

    return CheckpointPolicy.MUST_SAVE if func in SAC_SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def checkpoint_forward(block: nn.Module, selective: bool) -> None:
    """``block``'s forward through ``torch.utils.checkpoint.checkpoint(use_reentrant=False)``, as
    ``checkpoint(block, x, use_reentrant=False)`` in the script would run it; ``selective``: with
    the policy that saves matmuls and attention (``create_selective_checkpoint_contexts``)."""
    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

    forward = block.forward
    extra: dict[str, Any] = {}
    if selective:
        extra["context_fn"] = functools.partial(create_selective_checkpoint_contexts, _sac_policy)

    def checkpointed(*args: Any, **kwargs: Any) -> Any:
        return checkpoint(forward, *args, use_reentrant=False, **extra, **kwargs)

    block.forward = checkpointed


# ---------------------------------------------------------------------- LoRA
class LoraLinear(nn.Module):
    """peft's ``lora.Linear`` as it computes (no dropout: peft's default ``lora_dropout=0``):
    ``base(x) + lora_B(lora_A(x)) * alpha / r``, the adapters on the base weight's device, in its
    dtype for fp32 and in fp32 for a 16-bit base (peft's ``autocast_adapter_dtype``)."""

    def __init__(self, base: Any, rank: int, adapter_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        weight = base.weight
        in_features, out_features = linear_features(base)
        dtype = adapter_dtype or (torch.float32 if weight.dtype in (torch.float16, torch.bfloat16) else weight.dtype)
        if not dtype.is_floating_point:
            dtype = torch.float32
        self.base_layer = base
        self.lora_A = nn.Linear(in_features, rank, bias=False, device=weight.device, dtype=dtype)
        self.lora_B = nn.Linear(rank, out_features, bias=False, device=weight.device, dtype=dtype)
        self.scaling = LORA_ALPHA / rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        result = self.base_layer(x)
        result_dtype = result.dtype
        x = x.to(self.lora_A.weight.dtype)
        result = result + self.lora_B(self.lora_A(x)) * self.scaling
        return result.to(result_dtype)


def hf_conv1d(module: nn.Module) -> bool:
    """transformers' ``Conv1D`` (GPT-2's attention and MLP): a Linear whose weight is stored
    transposed, ``(in, out)``. Known by its class's home, so transformers need not be imported."""
    return type(module).__name__ == "Conv1D" and type(module).__module__.startswith("transformers.")


def is_linear(module: nn.Module) -> bool:
    """A layer LoRA and 4-bit quantization act on, as peft's and transformers' bitsandbytes
    integration take them: ``nn.Linear``, transformers' ``Conv1D``, or one already quantized."""
    return isinstance(module, (nn.Linear, NF4Linear)) or hf_conv1d(module)


def linear_features(module: Any) -> tuple[int, int]:
    """``(in_features, out_features)`` of a Linear, or of a Conv1D from its transposed weight."""
    if hf_conv1d(module):
        fan_in, fan_out = module.weight.shape
        return int(fan_in), int(fan_out)
    return int(module.in_features), int(module.out_features)


def _linear_names(model: nn.Module, blocks: list[nn.Module], targets: list[str] | None) -> list[str]:
    """The qualified names of the layers LoRA adapts: those named by ``targets`` (the last part
    of the name, or a dotted suffix, as peft matches ``target_modules``) anywhere in the model,
    else every Linear or Conv1D (or NF4 linear) inside the blocks (peft's "all-linear")."""
    in_blocks = {id(m) for block in blocks for m in block.modules()}
    names = []
    for name, module in model.named_modules():
        if not is_linear(module):
            continue
        if targets is None:
            if id(module) in in_blocks:
                names.append(name)
        elif any(name == t or name.endswith("." + t) for t in targets):
            names.append(name)
    return names


def add_lora(
    model: nn.Module,
    blocks: list[nn.Module],
    rank: int,
    targets: list[str] | None,
    notes: dict[str, Any],
    use_peft: bool = True,
) -> None:
    """LoRA adapters of ``rank`` on the layers ``_linear_names`` finds (through peft when it is
    installed); none found is noted in ``notes["unmatched"]``, and the model is left as it was."""
    names = _linear_names(model, blocks, targets)
    if not names:
        wanted = ",".join(targets) if targets else "the blocks"
        notes.setdefault("unmatched", []).append(
            f"lora: no Linear or Conv1D layer matches {wanted} in {type(model).__name__}"
        )
        return
    # Conv1D keeps its weight transposed: peft adapts it with fan_in_fan_out (its own default for
    # GPT-2), and Linear layers without.
    transposed = any(hf_conv1d(model.get_submodule(name)) for name in names)
    peft_used = use_peft and importlib.util.find_spec("peft") is not None
    if peft_used:
        from peft import LoraConfig, inject_adapter_in_model

        config = LoraConfig(r=rank, lora_alpha=LORA_ALPHA, target_modules=names, fan_in_fan_out=transposed)
        inject_adapter_in_model(config, model)
    else:
        for name in names:
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name)
            base = getattr(parent, child)
            adapter_dtype = torch.bfloat16 if isinstance(base, NF4Linear) else None
            setattr(parent, child, LoraLinear(base, rank, adapter_dtype))
    for parameter_name, parameter in model.named_parameters():
        parameter.requires_grad_("lora_" in parameter_name)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    notes["lora"] = {"rank": rank, "targets": sorted({n.rsplit(".", 1)[-1] for n in names}), "layers": len(names),
                     "trainable_parameters": trainable, "peft": peft_used, "fan_in_fan_out": transposed}  # fmt: skip


# ---------------------------------------------------------------------- QLoRA
class _DequantizedLinear(torch.autograd.Function):
    """bitsandbytes' ``MatMul4Bit`` as it uses memory: the weight is dequantized to a full
    temporary for the matmul in forward, and again in backward for the input's gradient; nothing
    is saved (the 4-bit weight is frozen)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, layer: NF4Linear) -> torch.Tensor:
        ctx.layer = layer
        weight = layer.dequantized(x)
        return torch.nn.functional.linear(x, weight, layer.bias)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor, None]:
        weight = ctx.layer.dequantized(grad_output)
        return grad_output.matmul(weight), None


class NF4Linear(nn.Module):
    """A Linear stored as bitsandbytes' ``Linear4bit`` stores it (``quant_type="nf4"``,
    ``compress_statistics=True``, blocksize 64): the packed weight (two values a byte), the
    8-bit absmaxes with their fp32 second-level absmaxes, code and offset, the NF4 code; the
    bias as it was."""

    def __init__(self, base: nn.Linear) -> None:
        super().__init__()
        weight = base.weight
        count = weight.numel()
        device = weight.device
        self.in_features, self.out_features = linear_features(base)
        self.weight_dtype = weight.dtype
        blocks = -(-count // NF4_BLOCK)
        self.weight = nn.Parameter(
            torch.empty(((count + 1) // 2, 1), dtype=torch.uint8, device=device), requires_grad=False
        )
        self.register_buffer("absmax", torch.empty(blocks, dtype=torch.uint8, device=device))
        self.register_buffer(
            "nested_absmax", torch.empty(-(-blocks // NF4_NESTED_BLOCK), dtype=torch.float32, device=device)
        )
        self.register_buffer("nested_code", torch.empty(256, dtype=torch.float32, device=device))
        self.register_buffer("offset", torch.empty((), dtype=torch.float32, device=device))
        self.register_buffer("code", torch.empty(16, dtype=torch.float32, device=device))
        self.bias = base.bias
        if self.bias is not None:
            self.bias.requires_grad_(False)

    def dequantized(self, like: torch.Tensor) -> torch.Tensor:
        weight = torch.empty((self.out_features, self.in_features), dtype=self.weight_dtype, device=like.device)
        return weight if weight.dtype == like.dtype else weight.to(like.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        result: torch.Tensor = _DequantizedLinear.apply(x, self)
        return result


def quantize_nf4(model: nn.Module, blocks: list[nn.Module], notes: dict[str, Any]) -> None:
    """Every Linear of the blocks becomes an ``NF4Linear`` (as ``load_in_4bit`` leaves all but the
    output head quantized: here the blocks, which hold nearly all of them)."""
    count = 0
    for block in blocks:
        for name, module in list(block.named_modules()):
            if isinstance(module, nn.Linear) or hf_conv1d(module):
                parent_name, _, child = name.rpartition(".")
                parent = block.get_submodule(parent_name) if parent_name else block
                setattr(parent, child, NF4Linear(module))
                count += module.weight.numel()
    notes["qlora"] = {"quantized_parameters": count, "storage_bytes": qlora_storage_bytes(count)}
    if not count:
        notes.setdefault("unmatched", []).append(
            f"qlora: the blocks of {type(model).__name__} hold no Linear or Conv1D"
        )


def qlora_storage_bytes(count: int) -> int:
    blocks = -(-count // NF4_BLOCK)
    return (count + 1) // 2 + blocks + 4 * -(-blocks // NF4_NESTED_BLOCK)


# ---------------------------------------------------------------------- optimizers
def _user_lr(args: tuple[Any, ...], kwargs: dict[str, Any], default: float) -> float:
    lr = kwargs.get("lr", args[0] if args else default)
    return float(lr) if isinstance(lr, (int, float)) else default


class AdamW8bitLayout(torch.optim.Optimizer):
    """bitsandbytes' ``AdamW8bit`` / ``PagedAdamW8bit`` state, as ``Optimizer2State.init_state``
    lays it out: for a tensor of 4096 values or more, two uint8 states and two fp32 absmaxes per
    256 values (block-wise), sharing one pair of 256-entry quantization maps; smaller tensors keep
    two fp32 states. Paged: state buffers of 100k values or more are in CUDA managed memory,
    outside PyTorch's allocator (they page to the CPU under pressure). The update is one fused
    in-place kernel per tensor: no temporaries."""

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, paged: bool = False) -> None:
        super().__init__(params, {"lr": lr})
        self.paged = paged
        self.paged_bytes = 0
        self._qmaps: tuple[torch.Tensor, torch.Tensor] | None = None

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None or self.state[p]:
                    continue
                self.state[p] = self._init_state(p)
        return loss

    def _init_state(self, p: torch.Tensor) -> dict[str, Any]:
        state: dict[str, Any] = {"step": 0}
        eight_bit = p.numel() >= BNB_MIN_8BIT_SIZE
        dtype = torch.uint8 if eight_bit else torch.float32
        for key in ("state1", "state2"):
            if self.paged and p.numel() >= BNB_PAGED_MIN_SIZE:
                self.paged_bytes += p.numel() * dtype.itemsize
                state[key] = None
            else:
                state[key] = torch.zeros_like(p, dtype=dtype)
        if eight_bit:
            if self._qmaps is None:
                self._qmaps = (torch.zeros(256, device=p.device), torch.zeros(256, device=p.device))
            state["qmap1"], state["qmap2"] = self._qmaps
            blocks = -(-p.numel() // BNB_OPTIMIZER_BLOCK)
            state["absmax1"] = torch.zeros(blocks, dtype=torch.float32, device=p.device)
            state["absmax2"] = torch.zeros(blocks, dtype=torch.float32, device=p.device)
        return state


class CpuOffloadedOptimizer(torch.optim.Optimizer):
    """The optimizer's state and step on the CPU (torchao's ``CPUOffloadOptimizer``, DeepSpeed's
    ZeRO-Offload): each step copies the gradients to CPU copies of the parameters, steps the
    script's optimizer there, and copies the parameters back in place. The GPU keeps the
    parameters and gradients; the CPU holds fp32 state (fake tensors here: no CPU memory used)."""

    def __init__(
        self, params: Iterable[Any], inner_class: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        params = list(params)
        super().__init__(params, {"lr": _user_lr(args, kwargs, 1e-3)})
        self._pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        cpu_groups = []
        for group in self.param_groups:
            cpu_params = []
            for p in group["params"]:
                copy = torch.empty_like(p, device="cpu").requires_grad_(p.requires_grad)
                self._pairs.append((p, copy))
                cpu_params.append(copy)
            cpu_groups.append({"params": cpu_params})
        self.inner = inner_class(cpu_groups, *args, **kwargs)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = closure() if closure is not None else None
        for group, inner_group in zip(self.param_groups, self.inner.param_groups, strict=True):
            inner_group["lr"] = group["lr"]
        for gpu, cpu in self._pairs:
            cpu.grad = None if gpu.grad is None else gpu.grad.to("cpu", non_blocking=True)
        self.inner.step()
        for gpu, cpu in self._pairs:
            if gpu.grad is not None:
                gpu.copy_(cpu, non_blocking=True)
        return loss


def _replacing_optimizer(original: type, optimizer: str | None, offload: str | None, notes: dict[str, Any]) -> type:
    """A stand-in for ``torch.optim.<original>``: building it builds the lever's optimizer."""

    def build(params: Any, *args: Any, **kwargs: Any) -> torch.optim.Optimizer:
        lr = _user_lr(args, kwargs, 1e-3)
        replaced: torch.optim.Optimizer
        notes["optimizer_replaced"] = original.__name__
        notes["optimizer_lr"] = lr  # the script's (or torch's default): the recommendation writes it
        if offload == "optimizer":
            inner_class: Callable[..., Any] = original
            inner_args, inner_kwargs = args, kwargs
            if optimizer:
                inner_class, inner_args, inner_kwargs = _class_for(optimizer), (), {"lr": lr}
            replaced = CpuOffloadedOptimizer(params, inner_class, inner_args, inner_kwargs)
            notes["offload"] = "optimizer"
        elif optimizer in ("adamw8bit", "paged-adamw8bit"):
            replaced = AdamW8bitLayout(params, lr=lr, paged=optimizer == "paged-adamw8bit")
            _PAGED.append(replaced)
        else:
            assert optimizer is not None
            replaced = _class_for(optimizer)(params, lr=lr)
        return replaced

    def __new__(cls: type, *args: Any, **kwargs: Any) -> Any:
        return build(*args, **kwargs)

    return type(original.__name__, (original,), {"__new__": __new__, "__module__": original.__module__})


# Set by the child to a context in which a value read from the simulated GPU (``.item()``) is a
# placeholder: Adafactor reads parameter and update norms to scale its step, values that change
# no tensor's size.
PLACEHOLDER_VALUES: list[Callable[[], contextlib.AbstractContextManager[None]]] = []


def _adafactor_class() -> type:
    """``torch.optim.Adafactor`` whose step may read its norms as placeholders (their values
    scale the update; no size depends on them)."""
    base: Any = _ORIGINALS.get("Adafactor") or torch.optim.Adafactor

    def step(self: Any, closure: Callable[[], Any] | None = None) -> Any:
        with PLACEHOLDER_VALUES[0]() if PLACEHOLDER_VALUES else contextlib.nullcontext():
            return base.step(self, closure)

    return type("Adafactor", (base,), {"step": step})


def _class_for(optimizer: str) -> Callable[..., torch.optim.Optimizer]:
    if optimizer == "adafactor":
        return _adafactor_class()
    if optimizer == "sgd":
        return functools.partial(_ORIGINALS.get("SGD") or torch.optim.SGD, momentum=0.9)
    if optimizer in ("adamw8bit", "paged-adamw8bit"):
        return functools.partial(AdamW8bitLayout, paged=optimizer == "paged-adamw8bit")
    raise MemlensUsageError(f"optim={optimizer}: unknown")
