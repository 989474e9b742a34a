"""``memlens predict``: time and host memory to predict a training step of a 2.7B model.

    python benchmarks/bench_predict.py [--layers 32] [--d-model 2560] [--batch 4] [--seq 1024]

Builds a GPT-style decoder (the CS336 "xl" shape by default: 32 layers, d_model 2560, d_ff
10240, vocab 50257, about 2.7 billion parameters) on the simulated GPU and runs one training
step: forward, cross-entropy, backward, AdamW (foreach, as on CUDA). It prints the wall time
against the one-minute bound, and the host memory the process grew by, next to the same for a
model 32 times smaller: the prediction holds no tensor data, so host memory should not follow
the model's size (only the simulator's bookkeeping grows with the number of allocations).
"""

from __future__ import annotations

import argparse
import resource
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


def measure(label: str, **shape: int) -> tuple[float, int]:
    rss_before = max_rss_bytes()
    started = time.perf_counter()
    result = predict(train_step, stacks=False, gpu="h100-80gb", **shape)
    seconds = time.perf_counter() - started
    grown = max(0, max_rss_bytes() - rss_before)
    print(
        f"{label:>7}: {result.value / 1e9:6.2f} B params  {seconds:6.1f} s  peak allocated "
        f"{format_bytes(result.peak_allocated_bytes)}, reserved {format_bytes(result.peak_reserved_bytes)}"
        f"{'  OOM at ' + str(result.oom_at) if result.oom else ''}  host memory grew {format_bytes(grown)}"
    )
    return seconds, grown


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--d-model", type=int, default=2560)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=50257)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=1024)
    args = parser.parse_args()
    common = {"vocab": args.vocab, "heads": args.heads, "batch": args.batch, "seq": args.seq}
    # The small model first: the guard library is built (once) and torch warmed up outside the big run.
    _, small_grown = measure("small", d_model=args.d_model // 4, layers=max(1, args.layers // 2), **common)
    big_seconds, big_grown = measure("large", d_model=args.d_model, layers=args.layers, **common)
    ratio = big_seconds / TIME_LIMIT_S
    print(f"time for the large step: {big_seconds:.1f} s = {ratio:.2f} x the {TIME_LIMIT_S:.0f} s bound")
    print(f"peak host memory added by the large model after the small one: {format_bytes(big_grown)} "
          f"(the small one added {format_bytes(small_grown)}, imports included)")


if __name__ == "__main__":
    main()
