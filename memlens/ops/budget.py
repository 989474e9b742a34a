"""The theoretical budget: one mapping from options to the budget library, and one
reconciliation of a measured report with it.

``BudgetOptions`` is what a user can say about the model and the run, whichever face they say it
in (``memlens budget``/``memlens triage`` flags, the dashboard's budget form, the MCP ``budget``
tool). A field left ``None`` is filled from the recorder's sidecar where the file has one, and
else from the library's default, so every face starts from the same precision, optimizer and
shapes for the same run.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import msgspec

from memlens.errors import MemlensUsageError
from memlens.units import parse_count

if TYPE_CHECKING:
    from memlens.analysis.report import Report
    from memlens.budget import Budget, Reconciliation
    from memlens.files import OpenedFile
    from memlens.sidecar import Sidecar

__all__ = ["BudgetOptions", "estimate_budget", "reconcile_budget"]


class BudgetOptions(msgspec.Struct, frozen=True, kw_only=True):
    """What is known about the model and the run; ``None`` = from the sidecar, else the default."""

    params: float | str | None = None
    hidden: int | None = None
    layers: int | None = None
    heads: int | None = None
    kv_heads: int | None = None
    vocab: int | None = None
    ffn: int | None = None
    tie_embeddings: bool = False
    config: str | None = None  # a transformers-style config.json, by path
    precision: str | None = None
    optimizer: str | None = None
    optim_dtype: str | None = None
    grad_dtype: str | None = None
    galore_rank: int | None = None
    lora_rank: int | None = None
    lora_targets: str = "q_proj,v_proj"
    qlora: bool = False
    frozen_layers: int = 0
    batch: int | None = None
    seq: int | None = None
    grad_accum: int = 1
    checkpointing: str | None = None
    flash_attn: bool = True
    activation_formula: str = "megatron"
    chunked_loss: float | None = None
    zero_stage: int = 0
    world_size: int = 1
    offload_optimizer: bool = False
    offload_params: bool = False

    @property
    def describes_model(self) -> bool:
        """Whether the options alone say enough about the model for a budget."""
        return self.params is not None or self.config is not None or self.hidden is not None

    @property
    def given(self) -> bool:
        """Whether anything differs from the defaults (a budget was asked for)."""
        return self != BudgetOptions()


def estimate_budget(options: BudgetOptions, config_file: str | OpenedFile | None = None) -> Budget:
    """The budget for ``options`` with the library's defaults for what they leave open.

    ``config_file`` (an opened file, for faces that check paths) replaces ``options.config``."""
    from memlens.budget import ModelSpec, TrainingSetup, estimate
    from memlens.budget.training import parse_checkpointing

    params = options.params
    n_params = parse_count(params) if isinstance(params, str) else params
    config = config_file if config_file is not None else options.config
    sizes = {
        "hidden": options.hidden,
        "layers": options.layers,
        "heads": options.heads,
        "kv-heads": options.kv_heads,
        "vocab": options.vocab,
        "ffn": options.ffn,
    }
    if config is not None:
        given = [name for name, value in sizes.items() if value is not None]
        if given or options.tie_embeddings:
            raise MemlensUsageError(f"a config gives the sizes; drop {', '.join(given) or 'tie-embeddings'}")
        spec = ModelSpec.from_config_json(config, n_params=n_params)
    else:
        spec = ModelSpec.from_numbers(
            n_params,
            hidden_size=options.hidden,
            n_layers=options.layers,
            n_heads=options.heads,
            n_kv_heads=options.kv_heads,
            vocab_size=options.vocab,
            ffn_size=options.ffn,
            tie_embeddings=options.tie_embeddings,
        )
    mode, every = parse_checkpointing(options.checkpointing or "none")
    setup = TrainingSetup(
        precision=options.precision or "bf16-mixed",
        optimizer=options.optimizer or "adamw",
        optim_dtype=options.optim_dtype or "fp32",
        grad_dtype=options.grad_dtype,
        galore_rank=options.galore_rank,
        lora_rank=options.lora_rank,
        lora_targets=tuple(options.lora_targets.split(",")),
        qlora=options.qlora,
        frozen_layers=options.frozen_layers,
        micro_batch=options.batch or 1,
        seq_len=options.seq,
        grad_accum=options.grad_accum,
        checkpointing=mode,
        checkpoint_every=every,
        flash_attention=options.flash_attn,
        activation_formula=options.activation_formula,
        chunked_loss=options.chunked_loss,
        zero_stage=options.zero_stage,
        world_size=options.world_size,
        offload_optimizer=options.offload_optimizer,
        offload_params=options.offload_params,
    )
    return estimate(spec, setup)


# The optimizer classes a sidecar names, as the budget spells them (anything else: AdamW's state).
_OPTIMIZERS = {"sgd": "sgd", "adam": "adam", "adamw": "adamw", "adafactor": "adafactor", "muon": "muon",
               "adamw8bit": "adam-8bit", "adam8bit": "adam-8bit", "pagedadamw8bit": "adam-8bit"}
# Autocast and parameter dtypes as the budget's precisions and state dtypes.
_MIXED = {"torch.bfloat16": "bf16-mixed", "torch.float16": "fp16-mixed"}
_PURE = {"torch.float32": "fp32", "torch.bfloat16": "bf16", "torch.float16": "fp16"}
_STATE = {"torch.float32": "fp32", "torch.bfloat16": "bf16", "torch.float16": "fp16"}


def options_from_sidecar(options: BudgetOptions, sidecar: Sidecar | None) -> BudgetOptions:
    """``options`` with what they leave open filled from the recorder's sidecar: the parameter
    count, the model's dimensions and layer count, the first batch's size and sequence length,
    the precision (autocast's dtype over fp32 weights: mixed; else the weights' dtype), the
    optimizer and its state's dtype. What the sidecar does not say stays open (the defaults),
    but for the precision: a measured run whose weights' dtype nobody states is taken as fp32,
    as ``memlens triage`` always has.

    The same shapes the activation finding's per-layer theory reads, so the two agree."""
    filled: dict[str, Any] = {} if options.precision is not None else {"precision": "fp32"}
    model = sidecar.model if sidecar is not None else None
    if model is not None:
        config = model.config
        if options.params is None and options.config is None and model.parameters_trainable:
            filled["params"] = float(model.parameters_trainable)
        if options.config is None:  # a config file gives the sizes itself
            sizes = {"hidden": config.hidden_size, "layers": config.num_layers, "vocab": config.vocab_size}
            if options.heads is None and options.kv_heads is None and config.num_attention_heads is not None:
                sizes["heads"] = config.num_attention_heads
                sizes["kv_heads"] = config.num_key_value_heads
            filled |= {name: value for name, value in sizes.items()
                       if value is not None and getattr(options, name) is None}
        if model.inputs is not None:
            if options.batch is None:
                filled["batch"] = model.inputs.batch_size
            if options.seq is None:
                filled["seq"] = model.inputs.seq_len
        if options.precision is None:
            weights = model.main_dtype
            if model.autocast_dtype in _MIXED and weights in (None, "torch.float32"):
                filled["precision"] = _MIXED[model.autocast_dtype]
            elif weights in _PURE:
                filled["precision"] = _PURE[weights]
    optimizer = sidecar.optimizer if sidecar is not None else None
    if optimizer is not None:
        if options.optimizer is None and optimizer.class_name:
            name = _OPTIMIZERS.get(optimizer.class_name.lower(), "adamw")
            filled["optimizer"] = "sgd-momentum" if name == "sgd" and optimizer.momentum else name
        if options.optim_dtype is None and optimizer.state_dtype in _STATE:
            filled["optim_dtype"] = _STATE[optimizer.state_dtype]
    return msgspec.structs.replace(options, **filled)


def reconcile_budget(report: Report, device: int | None, options: BudgetOptions | None = None) -> Reconciliation | None:
    """The budget next to the measurement: ``options`` first, the recorder's sidecar for the rest.

    ``None`` when neither says enough about the model for a budget."""
    options = options_from_sidecar(options or BudgetOptions(), report.sidecar)
    if not options.describes_model:
        return None
    import dataclasses

    from memlens.budget import reconcile  # only now: most triages have no budget to reconcile
    from memlens.budget.reconcile import measured_batch_fit

    measured = report.device(device)
    budget = estimate_budget(options)
    reconciliation = reconcile(budget, measured)
    if measured.capacity_bytes and options.batch:
        # A recording's or a prediction's own activations, scaled, not the formula's: they hold
        # what the model's kernels keep (HF's eager GPT-2 keeps 2.6x Megatron's fused count).
        ran_out = any(finding.kind == "oom" for finding in measured.findings)
        fit = measured_batch_fit(measured, options.batch, measured.capacity_bytes, budget,
                                 reserved_bytes=measured.peak_reserved_bytes, ran_out=ran_out)
        reconciliation = dataclasses.replace(reconciliation, largest_batch=fit)
    return reconciliation
