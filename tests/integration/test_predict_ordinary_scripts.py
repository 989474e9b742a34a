"""``memlens predict`` on scripts written the way their libraries document them (issue 36).

Each script runs unmodified through the CLI in a fresh process, as a user runs it: a small CNN
with BatchNorm (``num_batches_tracked``: a one-element tensor made on the CPU and moved), HF
GPT-2 built from a ``GPT2Config`` in code (nothing is downloaded) with its default ``use_cache``.
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
pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

# What the dispatcher printed when a small tensor was made on the emulated device for real.
DISPATCH_DUMP = "Could not run 'aten::empty_strided' with arguments from the 'CUDA' backend"


def predict_script(tmp_path: Path, source: str, *options: str) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(source))
    # Offline: the models are built from configs in code, and a test must never reach the network.
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    command = [sys.executable, "-m", "memlens", "predict", "--json", *options, "--", "python", str(script)]
    return subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=280)


def printed(completed: subprocess.CompletedProcess[str]) -> str:
    """What the script printed: under --json, predict keeps stdout for its JSON and sends the
    script's own output to stderr."""
    return completed.stdout + completed.stderr


def json_result(completed: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    assert "{\n" in completed.stdout, completed.stdout[-2000:] + completed.stderr[-3000:]
    loaded: dict[str, Any] = json.loads(completed.stdout[completed.stdout.index("{\n") :])
    return loaded


BATCHNORM_CNN = """
    import torch
    from torch import nn


    class Block(nn.Module):
        def __init__(self, channels):
            super().__init__()
            self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
            self.bn1 = nn.BatchNorm2d(channels)
            self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
            self.bn2 = nn.BatchNorm2d(channels)

        def forward(self, x):
            out = torch.relu(self.bn1(self.conv1(x)))
            return torch.relu(x + self.bn2(self.conv2(out)))


    model = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU(),
        Block(16), Block(16), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10),
    ).cuda()
    alone = torch.nn.BatchNorm2d(8).cuda()
    counter = torch.tensor(0, device="cuda")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for _ in range(2):
        images = torch.randn(8, 3, 32, 32, device="cuda")
        labels = torch.randint(0, 10, (8,), device="cuda")
        loss = nn.functional.cross_entropy(model(images), labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    print("tracked on", model[1].num_batches_tracked.device, alone.num_batches_tracked.device, counter.device)
"""


def test_a_batchnorm_cnn_trains_on_the_emulated_device(tmp_path: Path) -> None:
    completed = predict_script(tmp_path, BATCHNORM_CNN)
    assert DISPATCH_DUMP not in completed.stderr
    assert completed.returncode == 0, completed.stdout[-2000:] + completed.stderr[-3000:]
    assert "tracked on cuda:0 cuda:0 cuda:0" in printed(completed)
    result = json_result(completed)
    assert result["fits"] is True and result["error"] is None
    # Every parameter and buffer lives on the device: 5 BatchNorms' and the loose one's
    # num_batches_tracked each take a block of their own, so the peak is well above the weights.
    assert result["model"]["parameters_trainable"] == sum(
        [3 * 16 * 9, 4 * 16 * 16 * 9, 5 * 2 * 16, 16 * 10 + 10, 2 * 8]
    )
    assert result["peak_allocated_bytes"] > result["model"]["parameter_bytes_total"]


GPT2 = """
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=512, n_positions=128,
                        bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config).to("cuda")
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-5)
    input_ids = torch.randint(0, config.vocab_size, (2, 32), device="cuda")
    model.train()
    for _ in range(2):
        outputs = model(input_ids=input_ids, labels=input_ids)
        outputs.loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()
    with torch.no_grad():
        cached = model(input_ids=input_ids)  # use_cache defaults to True: a DynamicCache
    print("cache layers", len(cached.past_key_values))
"""


def test_hf_gpt2_with_its_default_cache(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    completed = predict_script(tmp_path, GPT2)
    assert DISPATCH_DUMP not in completed.stderr
    assert completed.returncode == 0, completed.stdout[-2000:] + completed.stderr[-3000:]
    assert "cache layers 2" in printed(completed)
    result = json_result(completed)
    assert result["fits"] is True and result["optimizer"]["class"] == "AdamW"
    assert result["peak_allocated_bytes"] > 2 * result["model"]["parameter_bytes_total"]


# PyTorch's FSDP2 tutorial's shape: the process group from torchrun's variables, one GPU per
# local rank, every block sharded, then the root.
FSDP2 = """
    import os

    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("nccl")
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))


    class Block(nn.Module):
        def __init__(self, width):
            super().__init__()
            self.up = nn.Linear(width, 4 * width)
            self.down = nn.Linear(4 * width, width)

        def forward(self, x):
            return x + self.down(torch.relu(self.up(x)))


    model = nn.Sequential(*[Block(256) for _ in range(4)]).cuda()
    for block in model:
        fully_shard(block)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(2):
        loss = model(torch.randn(8, 256, device="cuda")).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    print("world", dist.get_world_size(), "rank", dist.get_rank())
    dist.destroy_process_group()
"""


def run_memlens(tmp_path: Path, *arguments: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    command = [sys.executable, "-m", "memlens", *arguments]
    return subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=280)


def test_torchrun_is_read_as_the_world_it_launches(tmp_path: Path) -> None:
    (tmp_path / "fsdp2.py").write_text(textwrap.dedent(FSDP2))
    launch = ["torchrun", "--standalone", "--nproc-per-node", "4", "fsdp2.py"]
    predicted = run_memlens(tmp_path, "predict", "--out", "predicted", "--", *launch)
    assert predicted.returncode == 0, predicted.stdout[-2000:] + predicted.stderr[-3000:]
    assert "world 4 rank 0" in printed(predicted) and "rank 0 of 4" in predicted.stdout
    sidecar = json.loads((tmp_path / "predicted" / "predicted.memlens.json").read_text())
    assert sidecar["world_size"] == 4
    # plan reads the same command line as the same world: its baseline is predict's rank 0.
    planned = run_memlens(tmp_path, "plan", "--json", "--out", "planned", "--", *launch)
    assert planned.returncode == 0, planned.stdout[-2000:] + planned.stderr[-3000:]
    plan = json.loads(planned.stdout[planned.stdout.index("{") :])
    baseline = plan["configs"][0]
    assert plan["world_size"] == 4 and baseline["fits"] is True, baseline
    assert baseline["peak_allocated_bytes"] == sidecar["peak_allocated_bytes"]


# peft's quicktour on GPT-2 (its Conv1D layers: fan_in_fan_out), with bitsandbytes installed:
# both import bitsandbytes' CUDA backend once torch.cuda.is_available() says True.
PEFT_GPT2 = """
    import bitsandbytes
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=512, n_positions=128,
                        bos_token_id=0, eos_token_id=0)
    lora = LoraConfig(r=8, lora_alpha=16, target_modules=["c_attn"], lora_dropout=0.05,
                      fan_in_fan_out=True, task_type="CAUSAL_LM")
    model = get_peft_model(GPT2LMHeadModel(config), lora).to("cuda")
    optimizer = torch.optim.AdamW((p for p in model.parameters() if p.requires_grad), lr=2e-4)
    input_ids = torch.randint(0, config.vocab_size, (2, 32), device="cuda")
    for _ in range(2):
        model(input_ids=input_ids, labels=input_ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    print("bitsandbytes", bitsandbytes.__version__)
"""


def test_peft_and_bitsandbytes_import_on_the_emulated_device(tmp_path: Path) -> None:
    pytest.importorskip("bitsandbytes", reason="bitsandbytes is not installed (pip install bitsandbytes)")
    pytest.importorskip("peft", reason="peft is not installed (pip install peft)")
    completed = predict_script(tmp_path, PEFT_GPT2)
    assert "_cuda_getCurrentRawStream" not in completed.stdout + completed.stderr
    assert completed.returncode == 0, completed.stdout[-2000:] + completed.stderr[-3000:]
    assert "bitsandbytes " in printed(completed)
    result = json_result(completed)
    assert result["fits"] is True
    # LoRA r=8 on each c_attn (64 -> 192): A is 8x64, B is 192x8, two layers.
    assert result["model"]["parameters_trainable"] == 2 * (8 * 64 + 192 * 8)


GPT2_TRAINING = """
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=512, n_positions=128,
                        bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config).to("cuda")
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-5)
    input_ids = torch.randint(0, config.vocab_size, (2, 32), device="cuda")
    for _ in range(2):
        model(input_ids=input_ids, labels=input_ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
"""


def test_plan_lora_adapts_gpt2s_conv1d_and_says_when_it_matches_nothing(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    (tmp_path / "train.py").write_text(textwrap.dedent(GPT2_TRAINING))
    tries = ["--try", "lora=8", "--try", "lora=8+lora-targets=q_proj"]
    planned = run_memlens(tmp_path, "plan", "--json", *tries, "--out", "planned", "--", "python", "train.py")
    assert planned.returncode == 0, planned.stdout[-2000:] + planned.stderr[-3000:]
    baseline, lora, unmatched = json.loads(planned.stdout[planned.stdout.index("{") :])["configs"]
    # Per block, rank 8: c_attn 64->192, attn.c_proj 64->64, mlp.c_fc 64->256, mlp.c_proj 256->64.
    assert lora["trainable_parameters"] == 2 * 8 * ((64 + 192) + (64 + 64) + (64 + 256) + (256 + 64))
    assert lora["notes"]["lora"]["targets"] == ["c_attn", "c_fc", "c_proj"]
    assert lora["fits"] is True and 0 < lora["peak_allocated_bytes"] < baseline["peak_allocated_bytes"]
    assert unmatched["fits"] is False
    assert unmatched["problem"] == "not applied: lora: no Linear or Conv1D layer matches q_proj in GPT2LMHeadModel"


CNN_AT_BATCH = BATCHNORM_CNN.replace("(8, 3, 32, 32", "(int(sys.argv[1]), 3, 32, 32").replace(
    "(8,), device", "(int(sys.argv[1]),), device"
).replace("import torch\n", "import sys\n    import torch\n", 1)


def trace_without_times(path: Path) -> list[dict[str, Any]]:
    """A snapshot's trace, each entry but its time (the clock of the run that wrote it)."""
    import pickle

    with open(path, "rb") as handle:
        snapshot = pickle.load(handle)
    return [{key: value for key, value in entry.items() if key != "time_us"} for entry in snapshot["device_traces"][0]]


def test_plan_runs_the_trace_predict_runs(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text(textwrap.dedent(CNN_AT_BATCH))
    predicted = run_memlens(tmp_path, "predict", "--no-stacks", "--out", "predicted", "--", "python", "train.py", "16")
    assert predicted.returncode == 0, predicted.stdout[-2000:] + predicted.stderr[-3000:]
    planned = run_memlens(tmp_path, "plan", "--out", "planned", "--", "python", "train.py", "16")
    assert planned.returncode == 0, planned.stdout[-2000:] + planned.stderr[-3000:]
    ours = trace_without_times(tmp_path / "predicted" / "predicted.pickle")
    plans = trace_without_times(tmp_path / "planned" / "00-baseline" / "predicted.pickle")
    assert len(ours) > 300
    first_difference = next((i for i, (a, b) in enumerate(zip(ours, plans, strict=False)) if a != b), None)
    assert (first_difference, len(plans)) == (None, len(ours))

    # --max's answer is the last batch predict says fits; one more does not.
    capacity = ["--capacity", "40MiB"]
    searched = run_memlens(tmp_path, "plan", "--json", *capacity, "--max", "B=1..256", "--out", "searched",
                           "--", "python", "train.py", "{B}")  # fmt: skip
    assert searched.returncode in (0, 1), searched.stdout[-2000:] + searched.stderr[-3000:]
    plan = json.loads(searched.stdout[searched.stdout.index("{") :])
    largest = plan["max"]["B"]
    assert largest is not None and 1 < largest < 256, [config["problem"] for config in plan["configs"]]
    for batch, status in ((largest, 0), (largest + 1, 1)):
        command = ["python", "train.py", str(batch)]
        answer = run_memlens(tmp_path, "predict", *capacity, "--out", f"at{batch}", "--", *command)
        assert answer.returncode == status, (batch, answer.stdout[-1500:])


# bitsandbytes' README: its optimizers in place of torch's, on a model already on the GPU.
BNB_OPTIMIZERS = """
    import sys

    import bitsandbytes as bnb
    import torch
    from torch import nn

    model = nn.Sequential(nn.Linear(1024, 4096), nn.ReLU(), nn.Linear(4096, 1024)).cuda()
    optimizer_class = {"8bit": bnb.optim.AdamW8bit, "paged": bnb.optim.PagedAdamW8bit}[sys.argv[1]]
    optimizer = optimizer_class(model.parameters(), lr=0.001, betas=(0.9, 0.995))
    for step in range(2):
        model(torch.randn(16, 1024, device="cuda")).pow(2).mean().backward()
        before = torch.cuda.memory_allocated()
        optimizer.step()
        if step == 0:
            print("state bytes", torch.cuda.memory_allocated() - before)
        optimizer.zero_grad()
"""


def _block(size: int) -> int:
    return -(-size // 512) * 512  # the caching allocator's smallest rounding


def _adamw8bit_state_bytes(sizes: list[int], paged: bool) -> int:
    """bitsandbytes' Optimizer2State.init_state: from 4096 values two uint8 states and an fp32
    absmax per 256 values each; below, two fp32 states; the two 256-entry maps moved to the GPU.
    Paged: state buffers of 100k values or more in managed memory, outside PyTorch's allocator."""
    total = 2 * _block(256 * 4)
    for n in sizes:
        if n < 4096:
            total += 2 * _block(4 * n)
            continue
        total += 2 * _block(4 * -(-n // 256))
        if not (paged and n >= 100_000):
            total += 2 * _block(n)
    return total


@pytest.mark.parametrize("variant", ["8bit", "paged"])
def test_bitsandbytes_8bit_optimizers_lay_their_state_out_as_bitsandbytes_does(tmp_path: Path, variant: str) -> None:
    pytest.importorskip("bitsandbytes", reason="bitsandbytes is not installed (pip install bitsandbytes)")
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(BNB_OPTIMIZERS))
    completed = run_memlens(tmp_path, "predict", "--json", "--out", "out", "--", "python", "train.py", variant)
    assert completed.returncode == 0, completed.stdout[-2000:] + completed.stderr[-3000:]
    state_bytes = int(printed(completed).split("state bytes ")[1].split()[0])
    sizes = [1024 * 4096, 4096, 4096 * 1024, 1024]
    assert state_bytes == _adamw8bit_state_bytes(sizes, paged=variant == "paged")
    assert json_result(completed)["optimizer"]["class"] == {"8bit": "AdamW8bit", "paged": "PagedAdamW8bit"}[variant]
