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
    optim_dtype: str = "fp32"
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
        optim_dtype=options.optim_dtype,
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


def options_from_sidecar(options: BudgetOptions, sidecar: dict[str, Any] | None) -> BudgetOptions:
    """``options`` with what they leave open filled from the recorder's sidecar."""
    sidecar = sidecar or {}
    model = sidecar.get("model") or {}
    filled: dict[str, Any] = {}
    if options.params is None and options.config is None and model.get("parameters_trainable"):
        filled["params"] = float(model["parameters_trainable"])
    if options.optimizer is None:
        optimizer_class = str((sidecar.get("optimizer") or {}).get("class", "adamw")).lower()
        filled["optimizer"] = optimizer_class if optimizer_class in ("sgd", "adam", "adamw", "adafactor") else "adamw"
    if options.precision is None:
        dtypes = model.get("parameter_bytes_by_dtype") or {}
        filled["precision"] = "fp32" if not dtypes or set(dtypes) == {"torch.float32"} else "bf16-mixed"
    return msgspec.structs.replace(options, **filled)


def reconcile_budget(report: Report, device: int | None, options: BudgetOptions | None = None) -> Reconciliation | None:
    """The budget next to the measurement: ``options`` first, the recorder's sidecar for the rest.

    ``None`` when neither says enough about the model for a budget."""
    from memlens.budget import reconcile

    options = options_from_sidecar(options or BudgetOptions(), report.sidecar)
    if not options.describes_model:
        return None
    return reconcile(estimate_budget(options), report.device(device))
