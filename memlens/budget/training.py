"""``TrainingSetup``: how the model is trained (precision, optimizer, PEFT, batch, sharding).

Every field is checked when the setup is built; a bad value raises ``MemlensUsageError`` with
one line that names the accepted values. Names people commonly type are normalised
(``"bf16-true"`` -> ``"bf16"``, ``"adamw8bit"`` -> ``"adam-8bit"``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import cast

from memlens.errors import MemlensUsageError
from memlens.units import parse_whole, shown

PRECISIONS: tuple[str, ...] = ("fp32", "bf16-mixed", "fp16-mixed", "bf16", "fp16")
OPTIMIZERS: tuple[str, ...] = (
    "sgd",
    "sgd-momentum",
    "adam",
    "adamw",
    "adam-8bit",
    "adafactor",
    "muon",
    "galore",
)
CHECKPOINTING: tuple[str, ...] = ("none", "full", "selective", "every")
# megatron: fused 16-bit kernels (Megatron-LM, FlashAttention-era stacks); hf-eager: eager
# PyTorch ops under bf16 autocast, as Hugging Face's GPT-2 (fp32 residual stream and GELU pow).
ACTIVATION_FORMULAS: tuple[str, ...] = ("megatron", "rule-of-thumb", "hf-eager")
STATE_DTYPES: dict[str, float] = {"fp32": 4, "bf16": 2, "fp16": 2}

_PRECISION_ALIASES = {
    "32": "fp32",
    "32-true": "fp32",
    "float32": "fp32",
    "bf16-true": "bf16",
    "bfloat16": "bf16",
    "16-mixed": "fp16-mixed",
    "amp": "fp16-mixed",
    "fp16-true": "fp16",
    "float16": "fp16",
    "16-true": "fp16",
}
_OPTIMIZER_ALIASES = {
    "momentum": "sgd-momentum",
    "sgdm": "sgd-momentum",
    "adam8bit": "adam-8bit",
    "adamw8bit": "adam-8bit",
    "adamw-8bit": "adam-8bit",
    "adam_8bit": "adam-8bit",
    "8bit-adam": "adam-8bit",
    "galore-adamw": "galore",
}
_STATE_DTYPE_ALIASES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def _choice(value: str, allowed: tuple[str, ...], aliases: dict[str, str], what: str) -> str:
    key = str(value).strip().lower()
    key = aliases.get(key, key)
    if key not in allowed:
        raise MemlensUsageError(f"unknown {what} {value!r} (use one of: {', '.join(allowed)})")
    return key


@dataclass(frozen=True)
class TrainingSetup:
    """One training configuration.

    precision: ``fp32``; ``bf16-mixed``/``fp16-mixed`` (16-bit weights and gradients, fp32
    master copy); pure ``bf16``/``fp16`` (no master copy).
    optimizer: see ``OPTIMIZERS``; ``galore`` needs ``galore_rank``. ``optim_dtype`` is the
    state's dtype (fp32 default; 8-bit Adam ignores it). ``grad_dtype`` None = the weights'.
    LoRA: ``lora_rank`` and ``lora_targets`` (module names, peft-style, or ``all-linear``);
    ``qlora`` keeps the base's block linears in 4-bit NF4 with their quantisation constants
    (double-quantised unless ``qlora_double_quant`` is False) and the embeddings, head, norms
    and biases in 16-bit, as bitsandbytes does; ``qlora_flat_base`` counts the whole base as
    the reference's flat P/2 instead. ``frozen_layers``: the first k blocks do not train.
    Batch: micro-batch ``micro_batch``, ``seq_len``, ``grad_accum``. ``checkpointing``:
    none/full/selective/every (every ``checkpoint_every``-th block keeps only its input).
    ``chunked_loss``: factor a chunked cross-entropy divides the fp32 logits by.
    ZeRO ``zero_stage`` 0-3 over ``world_size`` ranks; CPU offload of optimizer state or
    (stage 3) parameters.
    """

    precision: str = "bf16-mixed"
    optimizer: str = "adamw"
    optim_dtype: str = "fp32"
    grad_dtype: str | None = None
    galore_rank: int | None = None
    lora_rank: int | None = None
    lora_targets: tuple[str, ...] = ("q_proj", "v_proj")
    qlora: bool = False
    qlora_double_quant: bool = True
    qlora_flat_base: bool = False
    frozen_layers: int = 0
    micro_batch: int = 1
    seq_len: int | None = None
    grad_accum: int = 1
    checkpointing: str = "none"
    checkpoint_every: int = 1
    flash_attention: bool = True
    activation_formula: str = "megatron"
    chunked_loss: float | None = None
    zero_stage: int = 0
    world_size: int = 1
    offload_optimizer: bool = False
    offload_params: bool = False

    def __post_init__(self) -> None:
        set_ = object.__setattr__  # frozen dataclass: normalise in place once
        set_(self, "precision", _choice(self.precision, PRECISIONS, _PRECISION_ALIASES, "precision"))
        set_(self, "optimizer", _choice(self.optimizer, OPTIMIZERS, _OPTIMIZER_ALIASES, "optimizer"))
        set_(
            self,
            "optim_dtype",
            _choice(self.optim_dtype, tuple(STATE_DTYPES), _STATE_DTYPE_ALIASES, "optimizer-state dtype"),
        )
        if self.grad_dtype is not None:
            set_(
                self,
                "grad_dtype",
                _choice(self.grad_dtype, tuple(STATE_DTYPES), _STATE_DTYPE_ALIASES, "gradient dtype"),
            )
        set_(self, "checkpointing", _choice(self.checkpointing, CHECKPOINTING, {}, "checkpointing"))
        set_(
            self,
            "activation_formula",
            _choice(self.activation_formula, ACTIVATION_FORMULAS, {}, "activation formula"),
        )
        set_(self, "lora_targets", tuple(t.strip() for t in self.lora_targets if t.strip()))
        self._check_numbers()

    def _check_numbers(self) -> None:
        def positive(name: str, value: float | None) -> None:
            if value is not None and value <= 0:
                raise MemlensUsageError(f"{name} must be positive, not {value}")

        for name in ("micro_batch", "grad_accum", "world_size", "checkpoint_every"):
            positive(name, getattr(self, name))
        positive("seq_len", self.seq_len)
        positive("lora_rank", self.lora_rank)
        positive("galore_rank", self.galore_rank)
        if self.chunked_loss is not None and self.chunked_loss < 1:
            raise MemlensUsageError(
                f"the chunked-loss factor divides the logits; it must be >= 1, not {self.chunked_loss}"
            )
        if self.frozen_layers < 0:
            raise MemlensUsageError(f"frozen_layers cannot be negative, not {self.frozen_layers}")
        if self.zero_stage not in (0, 1, 2, 3):
            raise MemlensUsageError(f"ZeRO stage must be 0, 1, 2 or 3, not {self.zero_stage}")
        if self.optimizer == "galore" and self.galore_rank is None:
            raise MemlensUsageError("the galore optimizer needs a rank (--galore-rank)")
        if self.qlora and self.lora_rank is None:
            raise MemlensUsageError("QLoRA needs a LoRA rank (--lora-rank)")
        if self.lora_rank is not None and self.frozen_layers:
            raise MemlensUsageError("frozen layers and LoRA do not mix: LoRA already freezes the whole base")
        if self.offload_params and self.zero_stage != 3:
            raise MemlensUsageError("parameter offload needs ZeRO stage 3 (--zero 3)")

    # ---------------------------------------------------------------- derived
    @property
    def mixed(self) -> bool:
        return self.precision.endswith("-mixed")

    @property
    def weight_bytes_per_param(self) -> int:
        """Bytes of one stored weight: 4 in fp32, 2 otherwise (the reference's bf16 weights 2P)."""
        return 4 if self.precision == "fp32" else 2

    @property
    def grad_bytes_per_param(self) -> float:
        if self.grad_dtype is not None:
            return STATE_DTYPES[self.grad_dtype]
        return self.weight_bytes_per_param

    @property
    def state_bytes(self) -> float:
        return STATE_DTYPES[self.optim_dtype]

    @property
    def activation_bytes_scale(self) -> float:
        """The activation formulas count 16-bit values; fp32 training stores twice as much."""
        return 2.0 if self.precision == "fp32" else 1.0

    def with_batch(self, micro_batch: int) -> TrainingSetup:
        return replace(self, micro_batch=micro_batch)


def parse_checkpointing(text: str) -> tuple[str, int]:
    """``"none"|"full"|"selective"|"every:K"|"every-K"`` -> (mode, k) for the CLI."""
    value = text.strip().lower()
    for prefix in ("every:", "every-", "every="):
        if value.startswith(prefix):
            rest = value[len(prefix) :]
            if not rest.isdigit():
                raise MemlensUsageError(f"checkpointing {shown(text)}: every:K needs a whole K >= 1")
            return "every", parse_whole(rest, f"checkpointing {shown(text)}: K", minimum=1)
    if value == "every":
        raise MemlensUsageError("checkpointing every:K needs K (e.g. every:4)")
    return cast(str, _choice(value, ("none", "full", "selective"), {"off": "none", "no": "none"}, "checkpointing")), 1
