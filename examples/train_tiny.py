"""A tiny causal language model trained with AdamW: plain PyTorch, no memlens import.

    python examples/train_tiny.py --steps 6
    memlens record --out runs/tiny -- python examples/train_tiny.py --steps 6

The model is a few pre-norm transformer blocks over random byte tokens, small enough to
train for a handful of steps on a laptop CPU in about a second.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint


class Block(nn.Module):
    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.norm1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.norm2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, d_model = x.shape
        q, k, v = self.qkv(self.norm1(x)).chunk(3, dim=-1)
        q, k, v = (t.view(batch, seq, self.n_heads, -1).transpose(1, 2) for t in (q, k, v))
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(batch, seq, d_model))
        return x + self.mlp(self.norm2(x))


class TinyLM(nn.Module):
    def __init__(
        self, vocab: int = 256, d_model: int = 64, n_layers: int = 2, n_heads: int = 4, max_seq: int = 512
    ) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(max_seq, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_heads) for _ in range(n_layers))
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)
        self.d_model, self.n_heads, self.checkpointing = d_model, n_heads, False  # memlens reads d_model, n_heads

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.embed(tokens) + self.pos(positions)
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.checkpointing else block(x)
        return self.head(self.norm(x))


def train_step(model: TinyLM, optimizer: torch.optim.Optimizer, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--leak", action="store_true", help="log a held-out loss without no_grad and keep it (a leak)")
    parser.add_argument("--checkpoint", action="store_true", help="activation checkpointing per block")
    parser.add_argument("--device", default="auto", help="cpu, cuda, cuda:1 ... (auto: cuda when available)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> list[float]:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device)
    model = TinyLM(d_model=args.d_model, n_layers=args.layers, max_seq=max(512, args.seq)).to(device)
    model.checkpointing = args.checkpoint
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    held_out = torch.randint(0, 256, (args.batch, args.seq + 1), device=device)
    losses: list[torch.Tensor] = []
    history: list[float] = []
    for _ in range(args.steps):
        tokens = torch.randint(0, 256, (args.batch, args.seq + 1), device=device)
        loss = train_step(model, optimizer, tokens)
        if args.leak:
            # The classic leak: a logged loss computed outside torch.no_grad() and kept as a
            # tensor holds its whole autograd graph, activations included, step after step.
            logits = model(held_out[:, :-1])
            losses.append(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), held_out[:, 1:].reshape(-1)))
        history.append(loss.item())
    print(f"trained {args.steps} steps, final loss {history[-1]:.3f}")
    return history


if __name__ == "__main__":
    main()
