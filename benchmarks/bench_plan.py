"""``memlens plan``: ten configurations of a ~170M-parameter model, and the wall time they take.

    python benchmarks/bench_plan.py [--layers 12] [--d-model 1024] [--vocab 16000] [--batch 8] [--seq 512]

Writes a plain GPT-style training script (pre-norm blocks in an ``nn.ModuleList``, attention
through ``scaled_dot_product_attention``, AdamW, two steps; built on the CPU and moved with
``.cuda()``, as most scripts do) and plans it: the baseline and nine levers (ckpt, sac, lora=16,
qlora=16, three optimizers, offload=optimizer, expandable), each predicted in its own process,
as many at once as there are CPUs. It prints the plan's table and the wall time next to the
target (60 s on a 2-core machine), and each configuration's own prediction time.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import textwrap
import time
from pathlib import Path

TARGET_S = 60.0

SCRIPT = textwrap.dedent(
    """
    import sys
    import torch
    from torch import nn
    import torch.nn.functional as F

    layers, d, vocab, batch, seq = (int(v) for v in sys.argv[1:6])

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
            self.q, self.k, self.v, self.o = (nn.Linear(d, d, bias=False) for _ in range(4))
            self.up, self.down = nn.Linear(d, 4 * d, bias=False), nn.Linear(4 * d, d, bias=False)
        def forward(self, x):
            b, t, _ = x.shape
            h = self.norm1(x)
            q, k, v = (proj(h).view(b, t, 16, d // 16).transpose(1, 2) for proj in (self.q, self.k, self.v))
            x = x + self.o(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d))
            return x + self.down(F.gelu(self.up(self.norm2(x))))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(vocab, d)
            self.blocks = nn.ModuleList(Block() for _ in range(layers))
            self.norm = nn.LayerNorm(d)
            self.head = nn.Linear(d, vocab, bias=False)
        def forward(self, tokens):
            x = self.embed(tokens)
            for block in self.blocks:
                x = block(x)
            return self.head(self.norm(x))

    model = GPT().cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    for _ in range(2):
        tokens = torch.randint(0, vocab, (batch, seq), device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(tokens)
        loss = F.cross_entropy(logits.float().view(-1, vocab), tokens.view(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    """
)

TRIES = [
    "ckpt",
    "sac",
    "lora=16",
    "qlora=16",
    "optim=adamw8bit",
    "optim=paged-adamw8bit",
    "optim=adafactor",
    "offload=optimizer",
    "expandable",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--d-model", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=16000)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--capacity", default="24GiB")
    parser.add_argument("--jobs", type=int, default=None)
    args = parser.parse_args()

    from memlens.ops.plan import PlanOptions, plan
    from memlens.reporters.plan import render

    parameters = args.layers * 12 * args.d_model**2 + 2 * args.vocab * args.d_model
    with tempfile.TemporaryDirectory() as folder:
        script = Path(folder) / "train_gpt.py"
        script.write_text(SCRIPT)
        command = [
            "python",
            str(script),
            *(str(v) for v in (args.layers, args.d_model, args.vocab, args.batch, args.seq)),
        ]
        options = PlanOptions(command=command, capacity=args.capacity, tries=TRIES, out=str(Path(folder) / "plan"),
                              jobs=args.jobs)  # fmt: skip
        started = time.perf_counter()
        result = plan(options)
        wall = time.perf_counter() - started
        print(render(result))
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    print()
    print(f"model: ~{parameters / 1e6:.0f}M parameters; {len(result.configs)} configurations on {cpus} CPUs")
    for config in result.configs:
        label = "+".join(config.levers) or "baseline"
        print(f"  {label:24s} {'fits' if config.fits else 'does not fit':12s} {config.problem or ''}")
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    inside = sum(config.seconds for config in result.configs)
    print(f"each configuration's own prediction time, summed: {inside:.1f} s; load average {load:.1f}")
    print(f"wall time {wall:.1f} s   target {TARGET_S:.0f} s (2 cores)   ratio {wall / TARGET_S:.2f}")
    sys.exit(
        0
        if all(config.problem is None or config.problem.startswith("OUT OF MEMORY") for config in result.configs)
        else 1
    )


if __name__ == "__main__":
    main()
