"""``memlens predict``: time and host memory to predict a training step of a 2.7B model.

    python benchmarks/bench_predict.py [--layers 32] [--d-model 2560] [--batch 4] [--seq 1024]

Builds a GPT-style decoder (the CS336 "xl" shape by default: 32 layers, d_model 2560, d_ff
10240, vocab 50257, about 2.7 billion parameters) on the simulated GPU and runs one training
step: forward, cross-entropy, backward, AdamW (foreach, as on CUDA). Each model runs in a fresh
process. It prints the wall time against the one-minute bound, and each process's peak host
memory next to that of a model about 30 times smaller: the prediction holds no tensor data, so
host memory should not follow the model's size (only the simulator's bookkeeping grows, with the
number of allocations).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

import torch
from torch import nn

from memlens.predict import predict
from memlens.units import format_bytes

TIME_LIMIT_S = 60.0


class Block(nn.Module):
    def __init__(self, d_model: int, heads: int, d_ff: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.proj = nn.Linear(d_model, d_model, bias=False)
        self.norm2 = nn.LayerNorm(d_model)
        self.up = nn.Linear(d_model, d_ff, bias=False)
        self.down = nn.Linear(d_ff, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, d_model = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(batch, seq, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        attended = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(batch, seq, d_model))
        return x + self.down(nn.functional.gelu(self.up(self.norm2(x))))


class Decoder(nn.Module):
    def __init__(self, vocab: int, d_model: int, layers: int, heads: int, d_ff: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        self.blocks = nn.ModuleList(Block(d_model, heads, d_ff) for _ in range(layers))
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def train_step(vocab: int, d_model: int, layers: int, heads: int, batch: int, seq: int) -> int:
    model = Decoder(vocab, d_model, layers, heads, 4 * d_model).to("cuda")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = torch.randint(0, vocab, (batch, seq), device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        logits = model(tokens)
    loss = nn.functional.cross_entropy(logits.float().view(-1, vocab), tokens.view(-1))
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return sum(p.numel() for p in model.parameters())


def max_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def measure(**shape: int) -> dict[str, float]:
    started = time.perf_counter()
    result = predict(train_step, stacks=False, gpu="h100-80gb", **shape)
    seconds = time.perf_counter() - started
    return {
        "parameters": result.value,
        "seconds": seconds,
        "peak_allocated_bytes": result.peak_allocated_bytes,
        "peak_reserved_bytes": result.peak_reserved_bytes,
        "oom": result.oom,
        "max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }


def in_fresh_process(shape: dict[str, int]) -> dict[str, float]:
    command = [sys.executable, __file__, "--measure", json.dumps(shape)]
    completed = subprocess.run(command, capture_output=True, text=True, check=True)
    return dict(json.loads(completed.stdout.strip().splitlines()[-1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--d-model", type=int, default=2560)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=50257)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--measure", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(**json.loads(args.measure))))
        return
    common = {"vocab": args.vocab, "heads": args.heads, "batch": args.batch, "seq": args.seq}
    shapes = {
        "small": {"d_model": args.d_model // 4, "layers": max(1, args.layers // 2), **common},
        "large": {"d_model": args.d_model, "layers": args.layers, **common},
    }
    figures = {label: in_fresh_process(shape) for label, shape in shapes.items()}
    for label, row in figures.items():
        print(
            f"{label:>6}: {row['parameters'] / 1e9:5.2f} B params  {row['seconds']:5.1f} s  "
            f"peak allocated {format_bytes(row['peak_allocated_bytes'])}, reserved "
            f"{format_bytes(row['peak_reserved_bytes'])}{'  OOM' if row['oom'] else ''}  "
            f"host memory peak {format_bytes(row['max_rss_bytes'])}"
        )
    large, small = figures["large"], figures["small"]
    print(f"time for the large step: {large['seconds']:.1f} s = {large['seconds'] / TIME_LIMIT_S:.2f} x the "
          f"{TIME_LIMIT_S:.0f} s bound")  # fmt: skip
    print(f"host memory, large / small model: {large['max_rss_bytes'] / small['max_rss_bytes']:.2f} x, for "
          f"{large['parameters'] / small['parameters']:.0f} x the parameters")  # fmt: skip


if __name__ == "__main__":
    main()
