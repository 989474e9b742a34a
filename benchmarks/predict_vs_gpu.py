"""``memlens predict`` on the CPU against the same programs run on a real GPU.

On the GPU machine (torch with CUDA), each workload writes its own snapshot:

    python benchmarks/predict_vs_gpu.py decoder --snapshot OUT/decoder.pickle
    python benchmarks/predict_vs_gpu.py convnet --snapshot OUT/convnet.pickle   # BatchNorm CNN
    python benchmarks/predict_vs_gpu.py gpt2 --snapshot OUT/gpt2.pickle         # HF GPT-2, defaults

and the CS336 recipes write theirs as their RECIPE.md says. Here, without a GPU:

    python benchmarks/predict_vs_gpu.py compare OUT --gpu h200 --recipes ../shared/real_snapshots/cs336_sources

runs ``memlens predict`` on the same programs and prints, per workload, the real and predicted
peak allocated and reserved (same reader, same definition) and the share of the real
allocations matched size for size. The ``decoder`` workload is a GPT-style training step that
exercises what the recipes do not: bf16 autocast, fused (flash) attention, a foreach AdamW.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]

# name -> (recipe folder, script, extra PYTHONPATH entries, file the script writes)
RECIPES = {
    "silmont2000": ("silmont2000/mem_snapshot", "cs336_systems/trace_peak_memory.py", [], "mem_snapshot.pickle"),
    "MAGMA27": ("MAGMA27", "cs336_systems/benchmarking_script.py", ["cs336-basics"], "memory_snapshot.pickle"),
    "bcrafton": ("bcrafton", "benchmarking_script.py", ["."], "memory_snapshot.pickle"),
}


def decoder_workload(snapshot: str, layers: int, d_model: int, batch: int, seq: int) -> None:
    """Two training steps; the second one recorded and dumped (the first warms the caches)."""
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_predict import Decoder

    vocab = 32000
    model = Decoder(vocab, d_model, layers, d_model // 64, 4 * d_model).to("cuda")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for step in range(2):
        if step == 1:
            torch.cuda.memory._record_memory_history(max_entries=1_000_000)
        tokens = torch.randint(0, vocab, (batch, seq), device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(tokens)
        loss = torch.nn.functional.cross_entropy(logits.float().view(-1, vocab), tokens.view(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    torch.cuda.memory._dump_snapshot(snapshot)
    torch.cuda.memory._record_memory_history(enabled=None)
    print(json.dumps({"max_memory_allocated": torch.cuda.max_memory_allocated(),
                      "max_memory_reserved": torch.cuda.max_memory_reserved()}))  # fmt: skip


def _record_second_step(snapshot: str, train_step: Callable[[], None]) -> None:
    """Two steps of ``train_step``; the second one recorded and dumped (the first warms the caches)."""
    import torch

    for step in range(2):
        if step == 1:
            torch.cuda.memory._record_memory_history(max_entries=1_000_000)
        train_step()
    torch.cuda.synchronize()
    torch.cuda.memory._dump_snapshot(snapshot)
    torch.cuda.memory._record_memory_history(enabled=None)
    print(json.dumps({"max_memory_allocated": torch.cuda.max_memory_allocated(),
                      "max_memory_reserved": torch.cuda.max_memory_reserved()}))  # fmt: skip


def convnet_workload(snapshot: str, batch: int) -> None:
    """A ResNet-style CNN with BatchNorm, as the PyTorch tutorials write one: built on the CPU, moved
    with ``.to("cuda")``, SGD with momentum, fp32 (BatchNorm's ``num_batches_tracked`` is a
    one-element tensor moved to the device, the case issue 36 found broken under predict)."""
    import torch
    from torch import nn

    def block(channels_in: int, channels_out: int, stride: int) -> nn.Module:
        return nn.Sequential(
            nn.Conv2d(channels_in, channels_out, 3, stride, 1, bias=False), nn.BatchNorm2d(channels_out),
            nn.ReLU(inplace=True), nn.Conv2d(channels_out, channels_out, 3, 1, 1, bias=False),
            nn.BatchNorm2d(channels_out), nn.ReLU(inplace=True),
        )  # fmt: skip

    model = nn.Sequential(
        nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(inplace=True), nn.MaxPool2d(3, 2, 1),
        block(64, 64, 1), block(64, 128, 2), block(128, 256, 2), block(256, 512, 2),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(512, 1000),
    ).to("cuda")  # fmt: skip
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    def train_step() -> None:
        images = torch.randn(batch, 3, 224, 224, device="cuda")
        labels = torch.randint(0, 1000, (batch,), device="cuda")
        loss = nn.functional.cross_entropy(model(images), labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    _record_second_step(snapshot, train_step)


def gpt2_workload(snapshot: str, batch: int, seq: int) -> None:
    """Hugging Face GPT-2 small from its config (nothing downloaded), with its defaults (``use_cache``
    on, eager attention as configured), bf16 autocast, AdamW: the way the transformers docs train."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config()).to("cuda")
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def train_step() -> None:
        tokens = torch.randint(0, model.config.vocab_size, (batch, seq), device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    _record_second_step(snapshot, train_step)


def predict_command(gpu: str, script: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "memlens", "predict", "--gpu", gpu, "--no-stacks", "--json", "--",
            "python", str(script), *args]  # fmt: skip


def compare_all(real_dir: Path, gpu: str, recipes: Path | None, decoder_args: list[str]) -> None:
    from memlens.predict.fidelity import compare
    from memlens.units import format_bytes

    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    rows = []
    with tempfile.TemporaryDirectory() as work:
        jobs: list[tuple[str, list[str], Path, dict[str, str], Path]] = []
        if (real_dir / "decoder.pickle").exists():
            written = Path(work) / "decoder.pickle"
            here = Path(__file__).resolve()
            command = predict_command(gpu, here, "decoder", "--snapshot", str(written), *decoder_args)
            jobs.append(("decoder", command, Path(work), env, written))
        for name, workload_args in (("convnet", CONVNET_ARGS), ("gpt2", GPT2_ARGS)):
            if (real_dir / f"{name}.pickle").exists():
                written = Path(work) / f"{name}.pickle"
                here = Path(__file__).resolve()
                command = predict_command(gpu, here, name, "--snapshot", str(written), *workload_args)
                jobs.append((name, command, Path(work), env, written))
        for name, (folder, script, paths, output) in RECIPES.items():
            if recipes is None or not (real_dir / f"{name}.pickle").exists():
                continue
            cwd = Path(work) / name
            cwd.mkdir()
            search = [str(REPO_ROOT), *(str(recipes / folder / p) for p in paths)]
            recipe_env = dict(env, PYTHONPATH=os.pathsep.join(search))
            jobs.append((name, predict_command(gpu, recipes / folder / script), cwd, recipe_env, cwd / output))
        for name, command, cwd, job_env, written in jobs:
            completed = subprocess.run(command, cwd=cwd, env=job_env, capture_output=True, text=True, check=False)
            if completed.returncode != 0 or not written.exists():
                rows.append(f"{name:>12}: prediction failed: {completed.stderr[-500:]}")
                continue
            fidelity = compare(real_dir / f"{name}.pickle", written)
            rows.append(
                f"{name:>12}: allocated {format_bytes(fidelity.real_peak_allocated_bytes)} real, "
                f"{format_bytes(fidelity.predicted_peak_allocated_bytes)} predicted ({fidelity.allocated_error:.2%}); "
                f"reserved {format_bytes(fidelity.real_peak_reserved_bytes)} real, "
                f"{format_bytes(fidelity.predicted_peak_reserved_bytes)} predicted ({fidelity.reserved_error:.2%}); "
                f"allocations matched {fidelity.matched_allocs}/{fidelity.real_allocs} ({fidelity.match_rate:.1%})"
            )
    print("\n".join(rows))


# The ordinary-script workloads' shapes, the same on the GPU and under predict.
CONVNET_ARGS = ["--batch", "64"]
GPT2_ARGS = ["--batch", "8", "--seq", "512"]


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    decoder = commands.add_parser("decoder", help="run the decoder workload (on a GPU, or under memlens predict)")
    decoder.add_argument("--snapshot", required=True)
    decoder.add_argument("--layers", type=int, default=8)
    decoder.add_argument("--d-model", type=int, default=1024)
    decoder.add_argument("--batch", type=int, default=8)
    decoder.add_argument("--seq", type=int, default=1024)
    convnet = commands.add_parser("convnet", help="a BatchNorm CNN step (on a GPU, or under memlens predict)")
    convnet.add_argument("--snapshot", required=True)
    convnet.add_argument("--batch", type=int, default=64)
    gpt2 = commands.add_parser("gpt2", help="HF GPT-2 small with its defaults (on a GPU, or under memlens predict)")
    gpt2.add_argument("--snapshot", required=True)
    gpt2.add_argument("--batch", type=int, default=8)
    gpt2.add_argument("--seq", type=int, default=512)
    compare = commands.add_parser("compare", help="predict every workload whose real snapshot is in REAL_DIR")
    compare.add_argument("real_dir", type=Path)
    compare.add_argument("--gpu", default="h200")
    compare.add_argument("--recipes", type=Path, default=None, help="the cs336_sources folder")
    args = parser.parse_args()
    if args.command == "decoder":
        decoder_workload(args.snapshot, args.layers, args.d_model, args.batch, args.seq)
    elif args.command == "convnet":
        convnet_workload(args.snapshot, args.batch)
    elif args.command == "gpt2":
        gpt2_workload(args.snapshot, args.batch, args.seq)
    else:
        compare_all(args.real_dir, args.gpu, args.recipes, [])


if __name__ == "__main__":
    main()
