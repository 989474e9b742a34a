"""Estimate the memory a training step needs, line by line, before (or next to) measuring it.

Prints weights, gradients, master weights, optimizer state, activations and logits in GiB
(2**30 bytes, the unit of every memlens output and of torch.cuda's numbers; --units gb for
1e9-byte GB), the static total and the total. Give the model as --params, as
sizes (--hidden --layers --heads --kv-heads --vocab --ffn) or as a transformers config.json
(--config, read from disk). With --capacity (e.g. 80GiB, 24GB; a unit is required) it
says whether the step fits and the largest micro-batch that does, and which item limits it.

Examples:

  memlens budget --params 7e9 --optimizer adamw --precision bf16-mixed

  memlens budget --config llama/config.json --lora-rank 16 --lora-targets q,k,v,o --qlora
  --batch 4 --seq 2048 --checkpointing full --capacity 24GB
"""

from __future__ import annotations

import click

from memlens.cli.common import COUNT, INDEX, Real, Whole, help_text, json_text
from memlens.ops.budget import BudgetOptions, estimate_budget
from memlens.ops.vocab import parse_capacity


@click.command(help=help_text(__doc__))
@click.option("--params", "params", default=None, help="Parameter count P: 7e9, 7B, 350M.")
@click.option("--hidden", type=COUNT, default=None, help="Hidden size d.")
@click.option("--layers", type=COUNT, default=None, help="Transformer layers L.")
@click.option("--heads", type=COUNT, default=None, help="Attention heads a.")
@click.option("--kv-heads", type=COUNT, default=None, help="Key/value heads (GQA); default: --heads.")
@click.option("--vocab", type=COUNT, default=None, help="Vocabulary size V.")
@click.option("--ffn", type=COUNT, default=None, help="MLP intermediate size.")
@click.option("--tie-embeddings", is_flag=True, help="The output head shares the embedding matrix.")
@click.option(
    "--config",
    "config_path",
    type=click.Path(dir_okay=False),
    default=None,
    help="A transformers-style config.json (read locally, nothing downloaded).",
)
@click.option(
    "--precision",
    default="bf16-mixed",
    show_default=True,
    help="fp32, bf16-mixed, fp16-mixed (fp32 master weights), bf16, fp16 (pure).",
)
@click.option(
    "--optimizer",
    default="adamw",
    show_default=True,
    help="sgd, sgd-momentum, adam, adamw, adam-8bit, adafactor, muon, galore.",
)
@click.option("--optim-dtype", default="fp32", show_default=True, help="Optimizer-state dtype: fp32, bf16, fp16.")
@click.option("--grad-dtype", default=None, help="Gradient dtype if not the weights' (e.g. fp32 accumulation).")
@click.option("--galore-rank", type=COUNT, default=None, help="Projection rank for --optimizer galore.")
@click.option("--lora-rank", type=COUNT, default=None, help="Train LoRA adapters of this rank (base frozen).")
@click.option(
    "--lora-targets",
    default="q_proj,v_proj",
    show_default=True,
    help="Comma-separated modules to adapt (q,k,v,o,gate,up,down or all-linear).",
)
@click.option("--qlora", is_flag=True, help="Keep the frozen base in 4-bit NF4 (needs --lora-rank).")
@click.option("--frozen-layers", type=INDEX, default=0, help="Freeze the first K transformer layers.")
@click.option("--batch", type=COUNT, default=1, show_default=True, help="Micro-batch size B.")
@click.option("--seq", type=COUNT, default=None, help="Sequence length T (needed for activations and logits).")
@click.option("--grad-accum", type=COUNT, default=1, show_default=True, help="Gradient-accumulation steps A.")
@click.option(
    "--checkpointing",
    default="none",
    show_default=True,
    help="Activation checkpointing: none, full, selective, every:K.",
)
@click.option(
    "--flash-attn/--no-flash-attn",
    default=True,
    show_default=True,
    help="FlashAttention (no T x T score matrix).",
)
@click.option(
    "--activations",
    "activation_formula",
    default="megatron",
    show_default=True,
    help="Activation formula: megatron (34*T*B*d per layer, fused 16-bit kernels), hf-eager (88*T*B*d with SDPA, "
    "eager ops under bf16 autocast as Hugging Face's GPT-2: fp32 residual stream and GELU) or rule-of-thumb "
    "(24*B*T*d per layer).",
)
@click.option(
    "--chunked-loss",
    type=Real(minimum=1.0),
    default=None,
    metavar="FACTOR",
    help="Chunked cross-entropy: divide the fp32 logits by FACTOR.",
)
@click.option("--zero", "zero_stage", type=Whole(0, 3), default=0, show_default=True, help="ZeRO stage 0-3.")
@click.option("--world-size", type=COUNT, default=1, show_default=True, help="Data-parallel ranks N.")
@click.option("--offload-optimizer", is_flag=True, help="Keep master weights and optimizer state on the host.")
@click.option("--offload-params", is_flag=True, help="Keep parameters on the host (ZeRO-3).")
@click.option("--capacity", multiple=True, help="Device memory to fit, with its unit: 80GiB, 24GB, 141GB. Repeatable.")
@click.option("--units", "units_name", type=click.Choice(["gib", "gb"]), default="gib", show_default=True,
              help="Print GiB (2**30 bytes, as triage) or GB (1e9 bytes, as spec sheets).")
@click.option("--gib", is_flag=True, hidden=True, help="Kept for old scripts: GiB is the default.")
@click.option("--json", "as_json", is_flag=True, help="Print the line items and totals as JSON (bytes).")
def budget(
    params: str | None,
    hidden: int | None,
    layers: int | None,
    heads: int | None,
    kv_heads: int | None,
    vocab: int | None,
    ffn: int | None,
    tie_embeddings: bool,
    config_path: str | None,
    precision: str,
    optimizer: str,
    optim_dtype: str,
    grad_dtype: str | None,
    galore_rank: int | None,
    lora_rank: int | None,
    lora_targets: str,
    qlora: bool,
    frozen_layers: int,
    batch: int,
    seq: int | None,
    grad_accum: int,
    checkpointing: str,
    flash_attn: bool,
    activation_formula: str,
    chunked_loss: float | None,
    zero_stage: int,
    world_size: int,
    offload_optimizer: bool,
    offload_params: bool,
    capacity: tuple[str, ...],
    units_name: str,
    gib: bool,
    as_json: bool,
) -> None:
    from memlens.budget import render_budget

    result = estimate_budget(BudgetOptions(
        params=params, hidden=hidden, layers=layers, heads=heads, kv_heads=kv_heads, vocab=vocab, ffn=ffn,
        tie_embeddings=tie_embeddings, config=config_path, precision=precision, optimizer=optimizer,
        optim_dtype=optim_dtype, grad_dtype=grad_dtype, galore_rank=galore_rank, lora_rank=lora_rank,
        lora_targets=lora_targets, qlora=qlora, frozen_layers=frozen_layers, batch=batch, seq=seq,
        grad_accum=grad_accum, checkpointing=checkpointing, flash_attn=flash_attn,
        activation_formula=activation_formula, chunked_loss=chunked_loss, zero_stage=zero_stage,
        world_size=world_size, offload_optimizer=offload_optimizer, offload_params=offload_params))
    checks = [result.check(parse_capacity(text, "--capacity"), label=text.strip()) for text in capacity]
    if as_json:
        payload = result.to_json()
        payload["capacities"] = [check.to_json() for check in checks]
        click.echo(json_text(payload))
    else:
        click.echo(render_budget(result, binary=units_name == "gib", checks=checks), nl=False)
