"""``memlens plan --world-size 8`` on a 1B-parameter Llama-shaped model: FSDP2 over 8 ranks and
2-D FSDP2 + TP over a 2x4 mesh, the seconds each plan takes and each rank's figures against hand
arithmetic.

    python benchmarks/bench_plan_sharded.py [--layers 18] [--d-model 2048] [--ffn 5632] [--vocab 32000]

Writes the training script torchtitan's layout suggests (RMSNorm, attention through
``scaled_dot_product_attention``, SwiGLU, an untied output; built on ``meta``, sharded, then
``to_empty`` and initialised; fp32 AdamW, two steps, ``zero_grad(set_to_none=True)``) and plans
it once per layout, each in its own process (one rank of 8 each). The 2-D layout is the TP
tutorial's: ``parallelize_module`` on ``mesh["tp"]`` (q, k, v, w1, w3 column-wise; o, w2
row-wise; the embedding row-wise, the output column-wise), then ``fully_shard`` on
``mesh["dp"]``.

Hand arithmetic: after the last step, fp32 AdamW keeps 12 bytes per parameter a rank owns:
FSDP2 12P/8; 2-D 12 (tp_sharded/8 + replicated/2), the norms the only parameters TP replicates.
Every dimension divides by 8, so no shard is padded. The target is 120 s per plan on 2 cores.
"""

from __future__ import annotations

import argparse
import os
import pickle
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

TARGET_S = 120.0
WORLD_SIZE = 8

SCRIPT = textwrap.dedent(
    """
    import sys
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from torch.distributed.tensor import Replicate

    layout, layers, d, ffn, vocab, batch, seq = sys.argv[1], *(int(v) for v in sys.argv[2:8])
    head_dim = 128

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.wq, self.wk, self.wv, self.wo = (nn.Linear(d, d, bias=False) for _ in range(4))
        def forward(self, x):
            b, t, _ = x.shape
            q, k, v = (w(x).view(b, t, -1, head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
            return self.wo(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, -1))

    class FeedForward(nn.Module):
        def __init__(self):
            super().__init__()
            self.w1, self.w3 = nn.Linear(d, ffn, bias=False), nn.Linear(d, ffn, bias=False)
            self.w2 = nn.Linear(ffn, d, bias=False)
        def forward(self, x):
            return self.w2(F.silu(self.w1(x)) * self.w3(x))

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.attention_norm, self.ffn_norm = nn.RMSNorm(d), nn.RMSNorm(d)
            self.attention, self.feed_forward = Attention(), FeedForward()
        def forward(self, x):
            x = x + self.attention(self.attention_norm(x))
            return x + self.feed_forward(self.ffn_norm(x))

    class Llama(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok_embeddings = nn.Embedding(vocab, d)
            self.layers = nn.ModuleList(Block() for _ in range(layers))
            self.norm = nn.RMSNorm(d)
            self.output = nn.Linear(d, vocab, bias=False)
        def forward(self, tokens):
            x = self.tok_embeddings(tokens)
            for layer in self.layers:
                x = layer(x)
            return self.output(self.norm(x))

    dist.init_process_group("nccl")
    world = dist.get_world_size()
    with torch.device("meta"):
        model = Llama()
    if layout == "2d":
        mesh = init_device_mesh("cuda", (2, world // 2), mesh_dim_names=("dp", "tp"))
        tp_mesh, dp_mesh = mesh["tp"], mesh["dp"]
        parallelize_module(model, tp_mesh, {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate()),
            "output": ColwiseParallel(output_layouts=Replicate()),
        })
        for layer in model.layers:
            parallelize_module(layer, tp_mesh, {
                "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(),
                "attention.wv": ColwiseParallel(), "attention.wo": RowwiseParallel(),
                "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
                "feed_forward.w2": RowwiseParallel(),
            })
    else:
        dp_mesh = init_device_mesh("cuda", (world,))
    for layer in model.layers:
        fully_shard(layer, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)
    model.to_empty(device="cuda")
    for module in model.modules():
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, foreach=False)

    def train():
        for _ in range(2):
            tokens = torch.randint(0, vocab, (batch, seq), device="cuda")
            loss = F.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    train()
    """
)


def held_at_the_end(snapshot_path: str) -> int:
    """The bytes the rank's snapshot holds at its end as the tensors asked for them, less the
    cuBLAS workspaces (no tensor's)."""
    with open(snapshot_path, "rb") as handle:
        snapshot: dict[str, Any] = pickle.load(handle)  # the file this benchmark's plan just wrote
    return sum(
        block["requested_size"]
        for segment in snapshot["segments"]
        for block in segment["blocks"]
        if block["state"] == "active_allocated"
        and not any("getNewWorkspace" in str(frame.get("name")) for frame in block.get("frames", []))
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=18)
    parser.add_argument("--d-model", type=int, default=2048)
    parser.add_argument("--ffn", type=int, default=5632)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--capacity", default="80GiB")
    args = parser.parse_args()

    from memlens.ops.plan import PlanOptions, predict_configurations
    from memlens.plan.configurations import Configuration

    d, ffn, vocab, layers = args.d_model, args.ffn, args.vocab, args.layers
    norms = (2 * layers + 1) * d  # replicated by TP
    tp_sharded = layers * (4 * d * d + 3 * d * ffn) + 2 * vocab * d
    parameters = tp_sharded + norms
    owned = {"fsdp2": parameters // WORLD_SIZE, "2d": tp_sharded // WORLD_SIZE + norms // 2}
    print(f"model: {parameters:,} parameters ({layers} layers, d={d}, ffn={ffn}, vocab={vocab}); "
          f"world size {WORLD_SIZE}, batch {args.batch} x {args.seq}")  # fmt: skip
    failed = False
    with tempfile.TemporaryDirectory() as folder:
        script = Path(folder) / "train_llama.py"
        script.write_text(SCRIPT)
        numbers = (layers, d, ffn, vocab, args.batch, args.seq)
        command = ["python", str(script), "{LAYOUT}", *(str(v) for v in numbers)]
        for index, layout in enumerate(("fsdp2", "2d")):
            options = PlanOptions(command=command, world_size=WORLD_SIZE, capacity=args.capacity, jobs=1,
                                  out=str(Path(folder) / f"plan-{index}"))  # fmt: skip
            started = time.perf_counter()
            (config,) = predict_configurations(options, [Configuration(values={"LAYOUT": layout})])
            wall = time.perf_counter() - started
            expected = 12 * owned[layout]
            held = config.held_bytes or {}
            at_end = held_at_the_end(config.snapshot) if config.snapshot and os.path.exists(config.snapshot) else -1
            name = "FSDP2 over 8" if layout == "fsdp2" else "FSDP2 + TP, 2x4"
            print(f"{name}: {wall:.1f} s (target {TARGET_S:.0f} s, ratio {wall / TARGET_S:.2f}); "
                  f"the child's own {config.seconds:.1f} s; {'fits' if config.fits else config.problem}")  # fmt: skip
            print(f"  peak allocated {config.peak_allocated_bytes / 2**30:.2f} GiB, "
                  f"reserved {config.peak_reserved_bytes / 2**30:.2f} GiB")  # fmt: skip
            print(f"  held at the end: snapshot {at_end:,} B, plan {sum(held.values()):,} B "
                  f"({held}), by hand 12 x {owned[layout]:,} = {expected:,} B")  # fmt: skip
            print(f"  trainable parameters {config.trainable_parameters}, by hand {parameters:,}")
            failed |= not config.fits or at_end != expected or sum(held.values()) != expected
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"load average {load:.1f}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
