"""``estimate(spec, setup) -> Budget``: the theoretical memory of one training step, item by item.

Line items (bytes on one device, in this order): weights, gradients, master_weights,
optimizer_state, activations, activation_recompute (only with checkpointing: the one block
re-run during backward), logits. ``static_bytes`` is the first four; ``total_bytes`` all.
What is offloaded to the host is listed as ``host_bytes`` and not counted on the device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import msgspec

from memlens.budget import formulas
from memlens.budget.spec import Matrix, ModelSpec
from memlens.budget.training import TrainingSetup
from memlens.errors import MemlensUsageError
from memlens.units import GiB, capacity_bytes, format_bytes

STATIC_ITEMS: tuple[str, ...] = ("weights", "gradients", "master_weights", "optimizer_state")
BATCH_ITEMS: tuple[str, ...] = ("activations", "activation_recompute", "logits")

# Vectors (biases, norms) are well under 1% of a transformer's parameters; when the known
# matrices leave more than this share uncovered, the rest is assumed to be d x d matrices.
UNCOVERED_SHARE_AS_MATRICES = 0.02


@dataclass(frozen=True)
class LineItem:
    """One row of the budget: ``bytes`` on the device, the formula, and what it counts."""

    name: str
    bytes: int
    formula: str
    explanation: str = ""
    host_bytes: int = 0
    estimated: bool = True
    # What the item adds up from, (label, bytes) each, when it has more than one term (before
    # any ZeRO sharding): printed under the item, e.g. the 4-bit base and its constants.
    parts: tuple[tuple[str, int], ...] = ()

    def record(self) -> LineItemRecord:
        return LineItemRecord(self.name, self.bytes, self.bytes / 1e9, self.bytes / GiB, self.formula,
                              self.explanation, self.host_bytes, self.estimated,
                              [BudgetPart(label, value) for label, value in self.parts])

    def to_json(self) -> dict[str, Any]:
        return msgspec.to_builtins(self.record())


# The JSON form of a budget (``memlens budget --json``, the MCP budget tool), one struct each.
class BudgetPart(msgspec.Struct, frozen=True):
    name: str
    bytes: int


class LineItemRecord(msgspec.Struct, frozen=True):
    name: str
    bytes: int
    gb: float  # 1e9 bytes
    gib: float  # 2**30 bytes
    formula: str
    explanation: str
    host_bytes: int
    estimated: bool
    parts: list[BudgetPart]


class BatchFitRecord(msgspec.Struct, frozen=True):
    capacity_bytes: int
    micro_batch: int
    limiting_item: str
    total_bytes: int
    next_total_bytes: int
    limiting_bytes: int
    static_exceeds: bool
    explanation: str


class CapacityCheckRecord(msgspec.Struct, frozen=True):
    capacity: str  # as the user wrote it, or the bytes
    capacity_bytes: int
    fits: bool
    total_bytes: int
    max_micro_batch: BatchFitRecord | None
    max_micro_batch_unknown: str


class BudgetModelRecord(msgspec.Struct, frozen=True):
    source: str
    n_params: int
    adapter_params: int
    trainable_params: int
    hidden_size: int | None
    n_layers: int | None
    n_heads: int | None
    n_kv_heads: int | None
    vocab_size: int | None
    ffn_size: int | None
    param_bytes_by_dtype: dict[str, int]


class BudgetRecord(msgspec.Struct, frozen=True):
    units: str
    model: BudgetModelRecord
    setup: TrainingSetup
    items: list[LineItemRecord]
    static_bytes: int
    total_bytes: int
    host_bytes: int
    complete: bool
    notes: list[str]


@dataclass(frozen=True)
class BatchFit:
    """The largest micro-batch whose budget fits ``capacity_bytes``, and what stops the next one.

    ``next_total_bytes`` is what ``micro_batch + 1`` would need (``total_bytes`` is the need at
    ``micro_batch``, or at B = 1 when none fits); ``limiting_bytes`` the limiting item's share.
    """

    capacity_bytes: int
    micro_batch: int
    limiting_item: str
    total_bytes: int
    next_total_bytes: int
    limiting_bytes: int
    static_exceeds: bool = False

    def describe(self, *, binary: bool = True, capacity_label: str | None = None) -> str:
        """Why the next micro-batch does not fit, in GiB (``binary``) or GB, bytes formatted."""

        def size(n: int) -> str:
            return format_bytes(n, binary=binary)

        cap = capacity_label or size(self.capacity_bytes)
        if self.static_exceeds:
            return (
                f"static memory {size(self.total_bytes)} exceeds the capacity {cap} before any batch; "
                f"largest item: {self.limiting_item}"
            )
        if self.micro_batch == 0:
            return f"B = 1 needs {size(self.next_total_bytes)}; {self.limiting_item} is the largest per-batch item"
        return (
            f"B = {self.micro_batch + 1} would need {size(self.next_total_bytes)} > {cap}; "
            f"{self.limiting_item} is the largest per-batch item ({size(self.limiting_bytes)})"
        )

    @property
    def explanation(self) -> str:
        return self.describe()

    def record(self) -> BatchFitRecord:
        return BatchFitRecord(self.capacity_bytes, self.micro_batch, self.limiting_item, self.total_bytes,
                              self.next_total_bytes, self.limiting_bytes, self.static_exceeds, self.explanation)

    def to_json(self) -> dict[str, Any]:
        return msgspec.to_builtins(self.record())


@dataclass(frozen=True)
class CapacityCheck:
    """Whether a budget fits one device, and the largest micro-batch (None with the reason when unknown).

    ``label`` is the capacity as the user wrote it (``48GB``), echoed back next to its bytes.
    """

    capacity_bytes: int
    fits: bool
    total_bytes: int
    max_batch: BatchFit | None
    max_batch_unknown: str = ""
    label: str = ""

    def record(self) -> CapacityCheckRecord:
        return CapacityCheckRecord(self.label or str(self.capacity_bytes), self.capacity_bytes, self.fits,
                                   self.total_bytes, self.max_batch.record() if self.max_batch else None,
                                   self.max_batch_unknown)

    def to_json(self) -> dict[str, Any]:
        return msgspec.to_builtins(self.record())


@dataclass(frozen=True)
class Budget:
    """The estimate for one (spec, setup); items in the order of ``STATIC_ITEMS + BATCH_ITEMS``."""

    spec: ModelSpec
    setup: TrainingSetup
    items: tuple[LineItem, ...]
    trainable_params: int
    adapter_params: int
    notes: tuple[str, ...] = field(default=())

    def item(self, name: str) -> LineItem:
        for line in self.items:
            if line.name == name:
                return line
        known = ", ".join(line.name for line in self.items)
        raise MemlensUsageError(f"no budget item {name!r}; this budget has: {known}")

    def bytes_of(self, name: str) -> int:
        """Bytes of an item, 0 for one this setup does not have (e.g. activation_recompute)."""
        return next((line.bytes for line in self.items if line.name == name), 0)

    @property
    def total_bytes(self) -> int:
        return sum(line.bytes for line in self.items)

    @property
    def static_bytes(self) -> int:
        return sum(line.bytes for line in self.items if line.name in STATIC_ITEMS)

    @property
    def batch_bytes(self) -> int:
        return sum(line.bytes for line in self.items if line.name in BATCH_ITEMS)

    @property
    def host_bytes(self) -> int:
        return sum(line.host_bytes for line in self.items)

    @property
    def complete(self) -> bool:
        """False when an item could not be estimated (the total then leaves it out)."""
        return all(line.estimated for line in self.items)

    def fits(self, capacity: int | str) -> bool:
        """Whether the total fits ``capacity`` (bytes as an int, or a size with its unit such as ``"80GB"``)."""
        return self.total_bytes <= capacity_bytes(capacity)

    def max_micro_batch(self, capacity: int | str) -> BatchFit:
        """The largest micro-batch that fits ``capacity`` and the item that limits it."""
        return max_micro_batch(self.spec, self.setup, capacity)

    def check(self, capacity: int | str, label: str = "") -> CapacityCheck:
        """``fits`` and ``max_micro_batch`` together (the batch stays unknown, with why, if unsizable).

        ``label``: the capacity as the user wrote it (a string ``capacity`` is its own label).
        """
        cap = capacity_bytes(capacity)
        try:
            fit, why = self.max_micro_batch(cap), ""
        except MemlensUsageError as exc:
            fit, why = None, str(exc)
        label = label or (capacity.strip() if isinstance(capacity, str) else "")
        return CapacityCheck(cap, self.fits(cap), self.total_bytes, fit, why, label)

    def record(self) -> BudgetRecord:
        """The budget as its JSON form's struct: the line items in bytes (with GB = 1e9 and
        GiB = 2**30 values) and totals."""
        spec = self.spec
        model = BudgetModelRecord(spec.source, spec.n_params, self.adapter_params, self.trainable_params,
                                  spec.hidden_size, spec.n_layers, spec.n_heads, spec.n_kv_heads, spec.vocab_size,
                                  spec.ffn_size, dict(spec.param_bytes_by_dtype))
        return BudgetRecord("bytes (gb: 1e9 bytes, gib: 2**30 bytes)", model, self.setup,
                            [line.record() for line in self.items], self.static_bytes, self.total_bytes,
                            self.host_bytes, self.complete, list(self.notes))

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (``record``, encoded)."""
        return msgspec.to_builtins(self.record())


# ------------------------------------------------------------------------------------ helpers
def _adapter_shapes(spec: ModelSpec, setup: TrainingSetup) -> list[Matrix]:
    """LoRA's A (r x k) and B (d x r) for each adapted d x k matrix, or the module's own adapters."""
    if setup.lora_rank is None:
        return list(spec.adapter_matrices)
    r = setup.lora_rank
    shapes: list[Matrix] = []
    for m in spec.lora_matrices(setup.lora_targets):
        shapes.append(Matrix(f"{m.name}.lora_A", r, m.cols, m.count))
        shapes.append(Matrix(f"{m.name}.lora_B", m.rows, r, m.count))
    return shapes


def _trainable_inventory(
    spec: ModelSpec, setup: TrainingSetup, trainable: int, adapters: list[Matrix], notes: list[str]
) -> tuple[list[Matrix], int]:
    """The trainable 2-D matrices and the count of trainable values left over (vectors)."""
    if adapters or setup.lora_rank is not None:
        matrices = list(adapters)
        if setup.lora_rank is None and spec.n_trainable:  # a module whose base also trains
            matrices += [m for m in spec.matrices if m.trainable]
    elif spec.source.startswith("module:"):
        matrices = [m for m in spec.matrices if m.trainable]
    else:
        matrices = []
        layers = spec.n_layers or 1
        for m in spec.matrices:
            if m.in_blocks and setup.frozen_layers:
                count = m.count * (layers - setup.frozen_layers) // layers
                if count:
                    matrices.append(Matrix(m.name, m.rows, m.cols, count, m.in_blocks))
            else:
                matrices.append(m)
    rest = trainable - sum(m.numel for m in matrices)
    if rest < 0:  # P given smaller than the architecture implies: trust P, scale the matrices
        return matrices, 0
    if rest > UNCOVERED_SHARE_AS_MATRICES * trainable:
        d = spec.hidden_size
        if d is None:
            return matrices, -rest  # unknown shapes; the caller decides
        count = rest // (d * d)
        if count:
            matrices.append(Matrix("assumed_square", d, d, count))
            notes.append(f"{count * d * d:,} trainable parameters of unknown shape counted as {d} x {d} matrices")
            rest -= count * d * d
    return matrices, rest


def _optimizer_state(
    spec: ModelSpec, setup: TrainingSetup, trainable: int, adapters: list[Matrix], notes: list[str]
) -> tuple[int, str, str]:
    """(bytes, formula, explanation) of the optimizer state on all trainable parameters, unsharded."""
    opt, sb = setup.optimizer, setup.state_bytes
    dtype = setup.optim_dtype
    if opt == "sgd":
        return 0, "0", "plain SGD keeps no state"
    if opt == "sgd-momentum":
        return formulas.sgd_state_bytes(trainable, True, sb), f"{sb:g}N", f"one {dtype} momentum buffer"
    if opt in ("adam", "adamw"):
        return formulas.adam_state_bytes(trainable, sb), f"{2 * sb:g}N", f"first + second moment in {dtype}"
    if opt == "adam-8bit":
        return formulas.adam_8bit_state_bytes(trainable), "2N", "two block-wise quantised 8-bit moments"
    matrices, vectors = _trainable_inventory(spec, setup, trainable, adapters, notes)
    if vectors < 0:
        if opt == "muon":
            notes.append("muon: shapes unknown, every trainable parameter counted as a 2-D hidden weight")
            return int(trainable * sb), f"{sb:g}N", f"one {dtype} momentum buffer (shapes unknown)"
        raise MemlensUsageError(f"the {opt} optimizer's state depends on the matrix shapes: give --hidden")
    if opt == "adafactor":
        values = sum(formulas.adafactor_state_values(m.rows, m.cols) * m.count for m in matrices) + vectors
        return (
            int(values * sb),
            "sum(rows + cols) per matrix",
            f"factored second moment in {dtype}, no first moment",
        )
    adam_values = 2 * (sum(m.numel for m in matrices if not m.in_blocks) + vectors)
    if opt == "muon":
        hidden = sum(m.numel for m in matrices if m.in_blocks)
        return (
            int((hidden + adam_values) * sb),
            f"{sb:g}N_2d + {2 * sb:g}N_rest",
            f"one {dtype} momentum buffer on block matrices; AdamW on embeddings, head and vectors",
        )
    rank = setup.galore_rank
    assert rank is not None  # checked by TrainingSetup
    galore = sum(formulas.galore_state_values(m.rows, m.cols, rank) * m.count for m in matrices if m.in_blocks)
    return (
        int((galore + adam_values) * sb),
        f"{sb:g}(2 r n + m r) per block matrix + {2 * sb:g}N_rest",
        f"Adam on rank-{rank} projections of block gradients ({dtype}); Adam on the rest",
    )


def _nf4_base(
    spec: ModelSpec, setup: TrainingSetup, notes: list[str]
) -> tuple[int, str, str, list[tuple[str, int]]]:
    """(bytes, formula, explanation, parts) of a QLoRA base as bitsandbytes holds it.

    Only the blocks' linear weights are quantised (``Linear4bit``); the embeddings, the output
    head, norms and biases stay in the compute dtype. The quantised values cost P_4/2 plus their
    NF4 constants (``formulas.nf4_constant_bytes``). ``qlora_flat_base``: the reference's flat P/2.
    """
    p = spec.n_params
    flat_all = formulas.nf4_weight_bytes(p)
    if setup.qlora_flat_base:
        return flat_all, "P/2", "4-bit NF4 base (flat P/2, constants and 16-bit layers left out)", []
    wb = setup.weight_bytes_per_param
    outside_blocks = sum(m.numel for m in spec.matrices if not m.in_blocks)
    if spec.vocab_size is None and outside_blocks == 0:
        notes.append("QLoRA: the embeddings and head are not known (no --vocab): counted as 4-bit")
    if spec.vector_params is None:
        notes.append("QLoRA: the norms are not known (no --hidden/--layers): counted as 4-bit")
    kept = min(p, outside_blocks + (spec.vector_params or 0))
    quantised = p - kept
    flat = formulas.nf4_weight_bytes(quantised)
    constants = formulas.nf4_constant_bytes(quantised, double_quant=setup.qlora_double_quant)
    kept_bytes = formulas.weight_bytes(kept, wb)
    kept_dtype = "fp32" if wb == 4 else "16-bit"
    bits = formulas.NF4_DOUBLE_QUANT_CONSTANT_BITS if setup.qlora_double_quant else formulas.NF4_CONSTANT_BITS
    dq = "double-quantised, " if setup.qlora_double_quant else ""
    parts = [
        (f"4-bit NF4 block linears ({quantised:,} values, P_4/2)", flat),
        (f"NF4 quantisation constants ({dq}{bits:.3f} bit per value)", constants),
        (f"{kept_dtype} embeddings, head, norms, biases ({kept:,} values)", kept_bytes),
    ]
    text = f"4-bit NF4 block linears and their constants; {kept_dtype} embeddings, head, norms"
    return flat + constants + kept_bytes, f"P_4/2 + {bits:.3f}P_4/8 + {wb}P_16", text, parts


def _shard(value: int, sharded: bool, world: int) -> int:
    return math.ceil(value / world) if sharded else value


# ------------------------------------------------------------------------------------ estimate
def estimate(spec: ModelSpec, setup: TrainingSetup | None = None) -> Budget:
    """The theoretical memory budget of one training step (reference: memory-budget.md)."""
    setup = setup or TrainingSetup()
    notes: list[str] = list(spec.assumptions)
    if setup.lora_rank is not None and spec.adapter_params:
        raise MemlensUsageError("this module already has LoRA adapters; do not ask for another LoRA rank")

    # ---- who trains
    adapters = _adapter_shapes(spec, setup)
    n_adapter = sum(m.numel for m in adapters) if setup.lora_rank is not None else spec.adapter_params
    peft = n_adapter > 0 or setup.lora_rank is not None
    if setup.lora_rank is not None:
        base_trainable = 0
    elif setup.frozen_layers:
        if spec.params_per_layer is None or spec.n_layers is None:
            raise MemlensUsageError("frozen layers need the per-layer size: give --hidden, --layers and --ffn")
        if setup.frozen_layers > spec.n_layers:
            raise MemlensUsageError(f"cannot freeze {setup.frozen_layers} of {spec.n_layers} layers")
        base_trainable = max(0, spec.trainable_base_params - setup.frozen_layers * spec.params_per_layer)
    else:
        base_trainable = spec.trainable_base_params
    trainable = base_trainable + n_adapter
    world, stage = setup.world_size, setup.zero_stage
    wb = setup.weight_bytes_per_param
    p = spec.n_params

    # ---- weights
    parts: list[tuple[str, int]] = []
    if setup.qlora:
        base_bytes, base_formula, base_text, parts = _nf4_base(spec, setup, notes)
    else:
        base_bytes = formulas.weight_bytes(p, wb)
        base_formula, base_text = f"{wb}P", f"{'fp32' if wb == 4 else '16-bit'} weights"
    adapter_bytes = formulas.weight_bytes(n_adapter, wb)
    weights = base_bytes + adapter_bytes
    if parts and peft:
        parts.append((f"LoRA adapters ({n_adapter:,} values, {wb}|theta|)", adapter_bytes))
    weight_formula = base_formula + (f" + {wb}|theta|" if peft else "")
    weight_text = f"{base_text}, P = {p:,}" + (" (MLP assumed d -> 4d -> d: no --ffn)" if spec.ffn_assumed else "")
    weight_text += f"; {n_adapter:,} adapter values |theta|" if peft else ""
    weights_dev = _shard(weights, stage >= 3, world)
    if stage >= 3 and world > 1:
        weight_formula, weight_text = f"({weight_formula})/N", weight_text + f"; ZeRO-3 over N = {world}"
    items = [
        LineItem(
            "weights",
            0,
            weight_formula,
            weight_text + "; offloaded to host",
            host_bytes=weights_dev,
            parts=tuple(parts),
        )
        if setup.offload_params
        else LineItem("weights", weights_dev, weight_formula, weight_text, parts=tuple(parts))
    ]

    # ---- gradients
    gb = setup.grad_bytes_per_param
    grads = _shard(formulas.gradient_bytes(trainable, gb), stage >= 2, world)
    grad_text = f"{'fp32' if gb == 4 else '16-bit'} gradients of {trainable:,} trainable parameters"
    if peft or trainable < p:
        grad_text += f" (frozen: {p + n_adapter - trainable:,}, none)"
    if setup.grad_accum > 1:
        grad_text += f"; held across {setup.grad_accum} accumulated micro-batches"
    grad_formula = f"{gb:g}N" + ("/N_ranks" if stage >= 2 and world > 1 else "")
    items.append(LineItem("gradients", grads, grad_formula, grad_text))

    # ---- master weights and optimizer state (sharded from stage 1, offloadable)
    def placed(name: str, value: int, formula: str, text: str) -> LineItem:
        value = _shard(value, stage >= 1, world)
        if stage >= 1 and world > 1:
            formula, text = f"({formula})/N_ranks", f"{text}; ZeRO-{stage} over {world} ranks"
        if setup.offload_optimizer:
            return LineItem(name, 0, formula, text + "; offloaded to host", host_bytes=value)
        return LineItem(name, value, formula, text)

    if setup.mixed:
        items.append(
            placed(
                "master_weights",
                formulas.master_weight_bytes(trainable),
                "4N",
                "fp32 master copy of the trainable parameters",
            )
        )
    else:
        items.append(LineItem("master_weights", 0, "0", f"{setup.precision}: no separate master copy"))
    state, state_formula, state_text = _optimizer_state(spec, setup, trainable, adapters, notes)
    items.append(placed("optimizer_state", state, state_formula, f"{setup.optimizer}: {state_text}"))

    items += _batch_items(spec, setup)
    for line in items:
        if not line.estimated:
            notes.append(f"{line.name} not estimated: {line.explanation}")
    if setup.grad_accum > 1 or world > 1:
        effective = setup.micro_batch * setup.grad_accum * world
        notes.append(f"effective batch B*A*N = {effective}; activations follow the micro-batch B = {setup.micro_batch}")
    return Budget(spec, setup, tuple(items), trainable, n_adapter, tuple(notes))


def _batch_items(spec: ModelSpec, setup: TrainingSetup) -> list[LineItem]:
    """Activations (and the recompute working set under checkpointing) and the logits."""
    b, t, d = setup.micro_batch, setup.seq_len, spec.hidden_size
    items: list[LineItem] = []
    missing = [flag for flag, value in (("--hidden", d), ("--layers", spec.n_layers), ("--seq", t)) if value is None]
    heads_needed = (setup.activation_formula in ("megatron", "hf-eager") and not setup.flash_attention
                    and spec.n_heads is None)
    if heads_needed:
        missing.append("--heads (attention scores without FlashAttention)")
    if missing:
        items.append(LineItem("activations", 0, "-", "needs " + ", ".join(missing), estimated=False))
    else:
        assert t is not None and d is not None and spec.n_layers is not None
        items += _activation_items(spec, setup, b, t, d, spec.n_layers)
    if t is None or spec.vocab_size is None:
        need = ", ".join(flag for flag, value in (("--vocab", spec.vocab_size), ("--seq", t)) if value is None)
        items.append(LineItem("logits", 0, "-", "needs " + need, estimated=False))
    else:
        factor = setup.chunked_loss
        formula = "B*T*V*4" + (f"/{factor:g}" if factor else "")
        text = f"fp32 logits, B*T = {b * t:,}, V = {spec.vocab_size:,}"
        text += f"; chunked cross-entropy ({factor:g}x smaller)" if factor else ""
        items.append(LineItem("logits", formulas.logits_bytes(b, t, spec.vocab_size, factor), formula, text))
    return items


def _activation_items(spec: ModelSpec, setup: TrainingSetup, b: int, t: int, d: int, n_layers: int) -> list[LineItem]:
    scale = setup.activation_bytes_scale
    element = 2 * scale
    # Frozen bottom blocks have no trainable parameter below them, so autograd saves nothing there.
    layers = n_layers - setup.frozen_layers
    if setup.activation_formula == "rule-of-thumb":
        per_layer = formulas.activation_rule_of_thumb_bytes(b, t, d, 1, element)
        formula = f"{int(12 * element)}*B*T*d per layer"
        source = "rule of thumb, 12 values per token per layer"
    elif setup.activation_formula == "hf-eager":
        # Derived under 16-bit autocast only: without autocast the same block keeps other dtypes.
        if not setup.precision.endswith("-mixed"):
            raise MemlensUsageError(f"--activations hf-eager is derived for bf16-mixed or fp16-mixed training, "
                                    f"not {setup.precision}")
        element = 4  # the residual stream, and so each block's input, stays fp32 under autocast
        per_layer = formulas.hf_eager_layer_activation_bytes(b, t, d, spec.n_heads,
                                                             flash_attention=setup.flash_attention)
        scale = 1.0
        formula = ("(88*T*B*d + 4*a*T*B)" if setup.flash_attention else "(86*T*B*d + 7*a*T^2*B)") + " per layer"
        source = ("eager kernels under bf16 autocast as HF's GPT-2 (fp32 residual stream, GELU's pow in fp32)"
                  + (", SDPA" if setup.flash_attention else ", eager attention (fp32 softmax kept)"))
    else:
        per_layer = formulas.megatron_layer_activation_bytes(
            b,
            t,
            d,
            spec.n_heads,
            flash_attention=setup.flash_attention,
            kv_ratio=spec.kv_ratio,
            bytes_scale=scale,
        )
        formula = "(34*T*B*d" + ("" if setup.flash_attention else " + 5*a*T^2*B") + ") per layer"
        source = ("Megatron-LM count, fused 16-bit kernels (bf16 GELU and residual; eager models keep more: "
                  "--activations hf-eager)"
                  + (", FlashAttention (no T^2 scores)" if setup.flash_attention else ""))
        if spec.kv_ratio != 1.0:
            source += f", GQA kv/heads = {spec.kv_ratio:g}"
    layer_text = f"{layers} layer(s)" + (
        f" ({setup.frozen_layers} frozen bottom layers save none)" if setup.frozen_layers else ""
    )
    if scale != 1.0:
        source += ", fp32 (x2)"
    mode = setup.checkpointing
    if mode == "none":
        return [LineItem("activations", per_layer * layers, f"L*{formula}", f"{source}; {layer_text}")]
    block_input = formulas.checkpointed_block_input_bytes(b, t, d, 1, element)
    recompute = LineItem(
        "activation_recompute", per_layer, formula, "one block's activations, rebuilt during its backward"
    )
    if mode == "full":
        stored = LineItem(
            "activations",
            block_input * layers,
            f"L*B*T*d*{element:g}",
            f"full checkpointing: block inputs only; {layer_text}",
        )
        return [stored, recompute]
    if mode == "selective":
        kept = formulas.selective_layer_activation_bytes(b, t, d, kv_ratio=spec.kv_ratio, bytes_scale=scale)
        stored = LineItem(
            "activations",
            kept * layers,
            "L*18*T*B*d",
            f"selective checkpointing: matmul and attention outputs kept; {layer_text}",
        )
        rebuilt = LineItem(
            "activation_recompute",
            max(0, per_layer - kept),
            "per-layer rest",
            "one block's recomputed elementwise outputs during its backward",
        )
        return [stored, rebuilt]
    k = setup.checkpoint_every
    checkpointed = math.ceil(layers / k)
    stored_bytes = checkpointed * block_input + (layers - checkpointed) * per_layer
    stored = LineItem(
        "activations",
        stored_bytes,
        f"ceil(L/{k})*B*T*d*{element:g} + rest*{formula}",
        f"every {k}th block checkpointed ({checkpointed} of {layers}); {source}",
    )
    return [stored, recompute]


def max_micro_batch(spec: ModelSpec, setup: TrainingSetup, capacity: int | str) -> BatchFit:
    """The largest micro-batch B whose total fits ``capacity``; 0 when the static memory alone does not."""
    cap = capacity_bytes(capacity)
    at_one = estimate(spec, setup.with_batch(1))
    if not at_one.item("activations").estimated:
        raise MemlensUsageError(
            "sizing the micro-batch needs the activations: " + at_one.item("activations").explanation
        )
    if at_one.static_bytes > cap:
        worst = max((line for line in at_one.items if line.name in STATIC_ITEMS), key=lambda line: line.bytes)
        return BatchFit(
            cap, 0, worst.name, at_one.static_bytes, at_one.total_bytes, worst.bytes, static_exceeds=True
        )
    per_sample = max(1, at_one.batch_bytes)
    low, high = 0, (cap - at_one.static_bytes) // per_sample + 2  # every batch item is linear in B
    while high - low > 1:
        mid = (low + high) // 2
        if estimate(spec, setup.with_batch(mid)).total_bytes <= cap:
            low = mid
        else:
            high = mid
    over = estimate(spec, setup.with_batch(low + 1))
    limiting = max((line for line in over.items if line.name in BATCH_ITEMS), key=lambda line: line.bytes)
    fitted = estimate(spec, setup.with_batch(low)).total_bytes if low else at_one.total_bytes
    return BatchFit(cap, low, limiting.name, fitted, over.total_bytes, limiting.bytes)
