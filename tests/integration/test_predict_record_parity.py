"""One script, one answer: ``memlens record --device cpu`` and ``memlens predict`` of the same
script agree (issue 32, part 1).

Each script is written the way users write them: the model built on the CPU and moved with
``.to(device)``, an ordinary loop, ``device`` chosen by ``torch.cuda.is_available()`` (the CPU
recorder runs it on the CPU, predict on the emulated GPU). Both runs go through the CLI in a fresh
process, and their files are triaged as ``memlens triage --json`` would. They must agree on the
leak (its bytes within 2%, the holder and the line that stores into it), on the model's shapes
(hidden size, heads, layers, vocabulary, batch and sequence), and on parameters, gradients and
optimizer state live at the peak (within 2%). Only what a CPU run cannot have differs: the cuBLAS
workspaces of the emulated GPU, which are their own category (``workspace``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]

# Two answers agree when they are this close (the bound).
AGREEMENT = 0.02

LEAKY_LIST = """
    import torch
    from torch import nn

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = nn.Sequential(nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 512)).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    acts = []
    for step in range(8):
        x = torch.randn(256, 512, device=device)
        loss = model(x).sum()
        acts.append(torch.empty(256, 1024, device=device))  # STORE: one 1 MiB block kept per step
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
"""

KEPT_LOSSES = """
    import torch
    import torch.nn.functional as F
    from torch import nn

    device = "cuda" if torch.cuda.is_available() else "cpu"


    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 10))

        def forward(self, x):
            return self.body(x)


    model = Net().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    history = []
    for step in range(6):
        x = torch.randn(128, 256, device=device)
        y = torch.randint(0, 10, (128,), device=device)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        history.append(loss)  # STORE: the loss and the graph it still holds
"""

GPT = """
    import torch
    import torch.nn.functional as F
    from torch import nn

    device = "cuda" if torch.cuda.is_available() else "cpu"


    class Block(nn.Module):
        def __init__(self, d_model, n_heads):
            super().__init__()
            self.n_heads = n_heads
            self.ln1 = nn.LayerNorm(d_model)
            self.qkv = nn.Linear(d_model, 3 * d_model)
            self.proj = nn.Linear(d_model, d_model)
            self.ln2 = nn.LayerNorm(d_model)
            self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

        def forward(self, x):
            b, t, c = x.shape
            q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=-1)
            q, k, v = (z.view(b, t, self.n_heads, -1).transpose(1, 2) for z in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
            return x + self.mlp(self.ln2(x))


    class GPT(nn.Module):
        def __init__(self, vocab=1000, d_model=128, n_layers=4, n_heads=4, block_size=64):
            super().__init__()
            self.d_model, self.n_layers, self.n_heads = d_model, n_layers, n_heads
            self.tok = nn.Embedding(vocab, d_model)
            self.pos = nn.Embedding(block_size, d_model)
            self.blocks = nn.ModuleList([Block(d_model, n_heads) for _ in range(n_layers)])
            self.ln = nn.LayerNorm(d_model)
            self.head = nn.Linear(d_model, vocab, bias=False)

        def forward(self, idx):
            x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
            for block in self.blocks:
                x = block(x)
            return self.head(self.ln(x))


    model = GPT().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    for step in range(4):
        idx = torch.randint(0, 1000, (8, 64), device=device)
        logits = model(idx)
        loss = F.cross_entropy(logits.view(-1, 1000), idx.view(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
"""

SCRIPTS = {"leaky_list": LEAKY_LIST, "kept_losses": KEPT_LOSSES, "gpt": GPT}
SHAPE_FIELDS = ("hidden_size", "num_attention_heads", "num_layers", "vocab_size")
CATEGORIES_THAT_AGREE = ("parameters", "gradients", "optimizer_state")


def _memlens(tmp_path: Path, *words: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    command = [sys.executable, "-m", "memlens", *words]
    completed = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=280)
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    return completed


def _triage(tmp_path: Path, snapshot: Path) -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(_memlens(tmp_path, "triage", "--json", "--no-cache", str(snapshot)).stdout)
    return loaded


def _both_runs(tmp_path: Path, source: str) -> tuple[dict[str, Any], dict[str, Any]]:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(source))
    _memlens(tmp_path, "record", "--device", "cpu", "--out", "recorded", "--", "python", str(script))
    _memlens(tmp_path, "predict", "--gpu", "h100-80gb", "--out", "predicted", "--", "python", str(script))
    return (_triage(tmp_path, tmp_path / "recorded" / "snapshot.pickle"),
            _triage(tmp_path, tmp_path / "predicted" / "predicted.pickle"))


def _agree(recorded: int, predicted: int) -> bool:
    return abs(recorded - predicted) <= AGREEMENT * max(recorded, predicted)


def _leaks(report: dict[str, Any]) -> list[dict[str, Any]]:
    found = []
    for finding in report["findings"]:
        if finding["kind"] != "leak":
            continue
        evidence = {item["name"]: item["value"] for item in finding["evidence"]}
        found.append({"bytes": finding["bytes"], "held_by": evidence.get("held_by"),
                      "held_by_line": evidence.get("held_by_line")})
    return found


@pytest.fixture(scope="module", params=sorted(SCRIPTS))
def runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Any, Any]:
    name = str(request.param)
    recorded, predicted = _both_runs(tmp_path_factory.mktemp(name), SCRIPTS[name])
    return name, recorded, predicted


def test_the_same_leak_the_same_bytes_holder_and_line(runs: tuple[str, Any, Any]) -> None:
    name, recorded, predicted = runs
    recorded_leaks, predicted_leaks = _leaks(recorded), _leaks(predicted)
    assert len(predicted_leaks) == len(recorded_leaks), (recorded_leaks, predicted_leaks)
    store_line = next((n for n, text in enumerate(textwrap.dedent(SCRIPTS[name]).splitlines(), 1) if "# STORE" in text),
                      None)
    assert bool(recorded_leaks) == (store_line is not None), recorded_leaks
    for mine, theirs in zip(recorded_leaks, predicted_leaks, strict=True):
        assert _agree(mine["bytes"], theirs["bytes"]), (mine, theirs)
        assert mine["held_by_line"] == theirs["held_by_line"] == f"train.py:{store_line}", (mine, theirs)
        assert mine["held_by"] == theirs["held_by"] is not None, (mine, theirs)


def test_the_same_model_shapes(runs: tuple[str, Any, Any]) -> None:
    name, recorded, predicted = runs
    recorded_model, predicted_model = recorded["sidecar"]["model"], predicted["sidecar"]["model"]
    if name == "gpt":  # the sizes its module carries
        assert [predicted_model["config"][field] for field in SHAPE_FIELDS] == [128, 4, 4, 1000]
    for field in SHAPE_FIELDS:
        assert recorded_model["config"][field] == predicted_model["config"][field], field
    assert recorded_model["inputs"] == predicted_model["inputs"]
    assert recorded_model["parameters_total"] == predicted_model["parameters_total"]


def test_parameters_gradients_and_optimizer_state_at_the_peak_agree(runs: tuple[str, Any, Any]) -> None:
    _, recorded, predicted = runs
    recorded_peak = recorded["devices"]["0"]["categories_at_peak"]
    predicted_peak = predicted["devices"]["0"]["categories_at_peak"]
    for category in CATEGORIES_THAT_AGREE:
        assert _agree(recorded_peak[category], predicted_peak[category]), (category, recorded_peak, predicted_peak)


EARLY_OOM = """
    import torch
    from torch import nn

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = nn.Sequential(nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 1024)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(3):
        x = torch.randn(8192, 1024, device=device)  # 32 MiB: more than the 30 MiB device holds
        loss = model(x).sum()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
"""
# The two Linear layers' weights and biases, in the allocator's 512-byte blocks.
EARLY_OOM_PARAMETER_BYTES = 2 * (1024 * 1024 * 4 + 4096)


def test_weights_moved_before_an_early_oom_are_parameters(tmp_path: Path) -> None:
    """Out of memory in the first forward: no optimizer.step() has told either run the model,
    and the weights already on the device are still parameters (``group --by category``)."""
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(EARLY_OOM))
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    for words, snapshot in (
        (["record", "--device", "cpu", "--capacity", "30MiB", "--out", "recorded"], "recorded/snapshot.pickle"),
        (["predict", "--capacity", "30MiB", "--out", "predicted"], "predicted/predicted.pickle"),
    ):
        run = subprocess.run([sys.executable, "-m", "memlens", *words, "--", "python", str(script)], cwd=tmp_path,
                             env=env, capture_output=True, text=True, timeout=280)
        assert run.returncode != 0 and "out of memory" in (run.stdout + run.stderr).lower(), run.stderr[-2000:]
        report = _triage(tmp_path, tmp_path / snapshot)
        assert report["devices"]["0"]["categories_at_peak"]["parameters"] == EARLY_OOM_PARAMETER_BYTES, snapshot
        grouped = _memlens(tmp_path, "group", "--by", "category", str(tmp_path / snapshot)).stdout
        assert any(line.split()[:1] == ["parameters"] for line in grouped.splitlines()), grouped
