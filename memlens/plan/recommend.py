"""The change to make in the user's code or launcher for a configuration: the recommendation.

Written from what the run found (the block class and its path, the layers LoRA adapted, the
optimizer replaced), so the lines can be pasted into the script.
"""

from __future__ import annotations

import shlex
from typing import Any

from memlens.plan.configurations import ChildResult, Configuration
from memlens.plan.levers import Lever


def change_for(configuration: Configuration, child: ChildResult, command: list[str]) -> str:
    """The code change and launcher line for ``configuration`` (no lever: "no change")."""
    from memlens.plan.configurations import substitute
    from memlens.plan.levers import alloc_conf

    notes = child.notes
    parts: list[str] = []
    for lever in configuration.levers:
        text = _lever_change(lever, configuration.levers, notes)
        if text:
            parts.append(text)
    launched = substitute(command, configuration.values)
    if configuration.world_size is not None:  # one of several world sizes: the one to launch at
        launched = on_ranks(launched, configuration.world_size)
    launch = shlex.join(launched)
    conf = alloc_conf(configuration.levers, "")
    if conf:
        launch = f"PYTORCH_CUDA_ALLOC_CONF={conf} {launch}"
    if not parts and not conf and not configuration.values and configuration.world_size is None:
        return "no change: the script fits as it is"
    return "\n".join([*parts, f"run: {launch}"])


def on_ranks(command: list[str], world_size: int) -> list[str]:
    """``command`` launched on ``world_size`` GPUs by torchrun: ``python train.py ARGS`` as
    ``torchrun --nproc-per-node N train.py ARGS`` (``-m pkg`` kept: torchrun takes it), any other
    program with ``--no-python``; at world size 1 too, where the script's process group and mesh
    need torchrun's environment as at any other."""
    from pathlib import PurePath

    if not command:
        return list(command)
    head = ["torchrun", "--nproc-per-node", str(world_size)]
    if PurePath(command[0]).name.startswith("python"):
        return [*head, *command[1:]]
    return [*head, "--no-python", *command]


def _optimizer_name(notes: dict[str, Any]) -> str:
    return str(notes.get("optimizer_replaced") or "AdamW")


def _learning_rate(notes: dict[str, Any]) -> str:
    """The script's learning rate as it built its optimizer (the plan's run saw it), so the line
    runs when pasted; never a literal ``lr=...``."""
    lr = notes.get("optimizer_lr")
    if isinstance(lr, int | float) and not isinstance(lr, bool):
        return repr(float(lr))
    # The optimizer was never built in the run: the script's own optimizer's, read back.
    return 'optimizer.param_groups[0]["lr"]'


def _lever_change(lever: Lever, levers: tuple[Lever, ...], notes: dict[str, Any]) -> str | None:
    blocks = notes.get("blocks") if isinstance(notes.get("blocks"), dict) else None
    block_class = str(blocks["class"]) if blocks else "Block"
    block_path = str(blocks["path"]) if blocks else "layers"
    hf = bool(notes.get("hf_model"))
    name, value = lever.name, lever.value
    if name == "ckpt":
        if hf:
            return 'model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})'
        return (
            "from functools import partial\n"
            "from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (\n"
            "    CheckpointImpl, apply_activation_checkpointing, checkpoint_wrapper)\n"
            "apply_activation_checkpointing(\n"
            "    model,\n"
            "    checkpoint_wrapper_fn=partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT),\n"
            f"    check_fn=lambda m: isinstance(m, {block_class}))"
        )
    if name == "sac":
        return (
            "from functools import partial\n"
            "from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts\n"
            "SAVE = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,\n"
            "        torch.ops.aten._scaled_dot_product_flash_attention.default,\n"
            "        torch.ops.aten._scaled_dot_product_efficient_attention.default}\n"
            "def policy(ctx, op, *args, **kwargs):\n"
            "    return CheckpointPolicy.MUST_SAVE if op in SAVE else CheckpointPolicy.PREFER_RECOMPUTE\n"
            f"# in the forward, for each block of model.{block_path}:\n"
            "x = checkpoint(block, x, use_reentrant=False,\n"
            "               context_fn=partial(create_selective_checkpoint_contexts, policy))"
        )
    if name in ("lora", "qlora"):
        lora = notes.get("lora") if isinstance(notes.get("lora"), dict) else {}
        targets = list(lora.get("targets", [])) if lora else []
        transposed = ", fan_in_fan_out=True" if lora and lora.get("fan_in_fan_out") else ""  # GPT-2's Conv1D
        config = f"LoraConfig(r={value}, lora_alpha=8, target_modules={targets!r}{transposed})"
        if name == "lora":
            return f"from peft import LoraConfig, get_peft_model\nmodel = get_peft_model(model, {config})"
        quantize = (
            "from transformers import BitsAndBytesConfig\n"
            "model = AutoModelForCausalLM.from_pretrained(..., quantization_config=BitsAndBytesConfig(\n"
            '    load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,\n'
            "    bnb_4bit_compute_dtype=torch.bfloat16))"
            if hf
            else f"# each nn.Linear of model.{block_path}[i] -> bitsandbytes.nn.Linear4bit(\n"
            '#     in, out, quant_type="nf4", compress_statistics=True, compute_dtype=torch.bfloat16),\n'
            "#     its weight loaded, then .cuda()"
        )
        return f"{quantize}\nfrom peft import LoraConfig, get_peft_model\nmodel = get_peft_model(model, {config})"
    if name == "optim":
        offloaded = any(other.name == "offload" for other in levers)
        if offloaded:
            return None  # said by the offload lever
        lr = _learning_rate(notes)
        return {
            "adamw8bit": f"import bitsandbytes as bnb\noptimizer = bnb.optim.AdamW8bit(model.parameters(), lr={lr})",
            "paged-adamw8bit": (
                f"import bitsandbytes as bnb\noptimizer = bnb.optim.PagedAdamW8bit(model.parameters(), lr={lr})"
            ),
            "adafactor": f"optimizer = torch.optim.Adafactor(model.parameters(), lr={lr})",
            "sgd": f"optimizer = torch.optim.SGD(model.parameters(), lr={lr}, momentum=0.9)",
        }.get(value or "")
    if name == "fsdp" or (name == "offload" and value == "params"):
        if name == "offload" and any(other.name == "fsdp" for other in levers):
            return None  # said by the fsdp lever
        offload = any(other.text() == "offload=params" for other in levers)
        policy = ", offload_policy=CPUOffloadPolicy()" if offload else ""
        imports = "CPUOffloadPolicy, fully_shard" if offload else "fully_shard"
        world = (notes.get("fsdp") or {}).get("world_size", 1)
        return (
            f"from torch.distributed.fsdp import {imports}\n"
            f"for block in model.{block_path}:\n"
            f"    fully_shard(block{policy})\n"
            f"fully_shard(model{policy})  # after model.cuda(), before building the optimizer\n"
            f"# launch: torchrun --nproc-per-node {world} ..."
        )
    if name == "offload":
        inner = f"torch.optim.{_optimizer_name(notes)}"
        for other in levers:
            if other.name == "optim" and other.value == "adafactor":
                inner = "torch.optim.Adafactor"
            elif other.name == "optim" and other.value == "sgd":
                inner = "torch.optim.SGD"
        lr = _learning_rate(notes)
        return ("from torchao.optim import CPUOffloadOptimizer\n"
                f"optimizer = CPUOffloadOptimizer(model.parameters(), {inner}, lr={lr})")  # fmt: skip
    return None  # allocator levers: in the launch line
