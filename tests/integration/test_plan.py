"""``memlens plan``: levers applied from outside the script predict what the same lever written by
hand predicts; ``--max`` is exact; ``--json`` has the issue's shape; bad input is one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from memlens.ops.plan import PlanOptions, plan, predict_configurations
from memlens.plan.configurations import Configuration
from memlens.plan.levers import parse_spec
from tests.conftest import REPO_ROOT

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]

# A small transformer-shaped model whose script can checkpoint its blocks or add LoRA adapters
# by hand (MODE), the way a user would write them.
SCRIPT = textwrap.dedent(
    """
    import sys
    import torch
    from torch import nn
    from functools import partial
    from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

    aten = torch.ops.aten
    SAVE = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default,
            aten._scaled_dot_product_flash_attention.default, aten._scaled_dot_product_efficient_attention.default}

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op in SAVE else CheckpointPolicy.PREFER_RECOMPUTE

    class HandLora(nn.Module):
        def __init__(self, base, rank):
            super().__init__()
            self.base_layer = base
            self.lora_A = nn.Linear(base.in_features, rank, bias=False)
            self.lora_B = nn.Linear(rank, base.out_features, bias=False)
            self.scaling = 8 / rank
        def forward(self, x):
            return self.base_layer(x) + self.lora_B(self.lora_A(x)) * self.scaling

    class Block(nn.Module):
        def __init__(self, d):
            super().__init__()
            self.norm = nn.LayerNorm(d)
            self.q = nn.Linear(d, d)
            self.v = nn.Linear(d, d)
            self.up = nn.Linear(d, 4 * d)
            self.down = nn.Linear(4 * d, d)
        def forward(self, x):
            h = self.norm(x)
            x = x + self.q(h) * torch.sigmoid(self.v(h))
            return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))

    class Model(nn.Module):
        def __init__(self, d=128, n=4):
            super().__init__()
            self.embed = nn.Linear(32, d)
            self.blocks = nn.ModuleList(Block(d) for _ in range(n))
            self.head = nn.Linear(d, 1000)  # 128k values: paged by a paged optimizer
        def forward(self, x, mode="plain"):
            x = self.embed(x)
            for block in self.blocks:
                if mode == "ckpt":
                    x = checkpoint(block, x, use_reentrant=False)
                elif mode == "sac":
                    x = checkpoint(block, x, use_reentrant=False,
                                   context_fn=partial(create_selective_checkpoint_contexts, policy))
                else:
                    x = block(x)
            return self.head(x)

    mode, batch = sys.argv[1], int(sys.argv[2])
    model = Model()
    if mode == "lora":
        for block in model.blocks:
            block.q, block.v = HandLora(block.q, 4), HandLora(block.v, 4)
        for name, p in model.named_parameters():
            p.requires_grad_("lora_" in name)
    model = model.cuda()
    optimizer = torch.optim.AdamW(model.parameters())
    for _ in range(2):
        x = torch.randn(batch, 64, 32, device="cuda")
        model(x, mode=mode).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    """
)


def _script(tmp_path: Path) -> Path:
    path = tmp_path / "train.py"
    path.write_text(SCRIPT)
    return path


def _close(a: int, b: int, tolerance: float) -> bool:
    return abs(a - b) <= tolerance * max(a, b)


def test_levers_from_outside_predict_what_the_script_written_by_hand_predicts(tmp_path: Path) -> None:
    script = _script(tmp_path)
    options = PlanOptions(command=["python", str(script), "{MODE}", "64"], out=str(tmp_path / "out"))
    by_hand = [Configuration(values={"MODE": mode}) for mode in ("plain", "ckpt", "lora", "sac")]
    from_outside = [
        Configuration(levers=parse_spec("ckpt"), values={"MODE": "plain"}),
        Configuration(levers=parse_spec("lora=4+lora-targets=q,v"), values={"MODE": "plain"}),
        Configuration(levers=parse_spec("sac"), values={"MODE": "plain"}),
    ]
    plain, hand_ckpt, hand_lora, hand_sac, ckpt, lora, sac = predict_configurations(options, by_hand + from_outside)
    for config in (plain, hand_ckpt, hand_lora, hand_sac, ckpt, lora, sac):
        assert config.fits, config.problem
    assert hand_ckpt.peak_allocated_bytes < plain.peak_allocated_bytes  # the lever does something here
    assert _close(ckpt.peak_allocated_bytes, hand_ckpt.peak_allocated_bytes, 0.01), (ckpt, hand_ckpt)
    assert _close(lora.peak_allocated_bytes, hand_lora.peak_allocated_bytes, 0.03), (lora, hand_lora)
    assert hand_sac.peak_allocated_bytes != plain.peak_allocated_bytes
    assert _close(sac.peak_allocated_bytes, hand_sac.peak_allocated_bytes, 0.01), (sac, hand_sac)
    assert lora.trainable_parameters == hand_lora.trainable_parameters == 4 * 2 * (4 * 128 + 4 * 128)
    blocks = ckpt.notes["blocks"]
    assert (blocks["path"], blocks["class"], blocks["count"]) == ("blocks", "Block", 4)
    # Checkpointing recomputes the blocks' forward: more floating-point work than the plain run.
    assert ckpt.flops is not None and plain.flops is not None and ckpt.flops > plain.flops


def test_optimizer_state_as_bitsandbytes_and_torch_lay_it_out(tmp_path: Path) -> None:
    script = _script(tmp_path)
    options = PlanOptions(command=["python", str(script), "plain", "2"], out=str(tmp_path / "out"))
    specs = ("optim=adamw8bit", "optim=sgd", "qlora=4", "offload=optimizer", "optim=paged-adamw8bit")
    configurations = [Configuration(), *(Configuration(levers=parse_spec(spec)) for spec in specs)]
    plain, eight_bit, sgd, qlora, offload, paged = predict_configurations(options, configurations)
    sizes = [p.numel() for p in _model_parameters(script)]
    # AdamW: two fp32 states per parameter (its step counts stay on the CPU).
    assert plain.held_bytes["optimizer_state"] == sum(2 * 4 * n for n in sizes)
    # bitsandbytes' AdamW8bit: uint8 states and an fp32 absmax per 256 values from 4096 values on.
    expected = 2 * 256 * 4  # the two shared 256-entry quantization maps
    for n in sizes:
        if n >= 4096:
            expected += 2 * n + 2 * 4 * -(-n // 256)
        else:
            expected += 2 * 4 * n
    assert eight_bit.held_bytes["optimizer_state"] == expected
    assert sgd.held_bytes["optimizer_state"] == sum(4 * n for n in sizes)  # one momentum buffer
    # QLoRA: the blocks' Linear weights at half a byte a value, with their constants.
    assert qlora.notes["qlora"]["quantized_parameters"] == 4 * (2 * 128 * 128 + 2 * 4 * 128 * 128)
    assert qlora.held_bytes["parameters"] < plain.held_bytes["parameters"] / 3
    # Offloaded: no optimizer state on the GPU; each step sends the gradients out and the
    # parameters back.
    assert offload.fits and offload.held_bytes["optimizer_state"] == 0
    assert offload.offload_bytes_per_step == 2 * 4 * sum(sizes)
    # Paged: the states of tensors of 100k values or more live outside PyTorch's allocator.
    paged_sizes = [n for n in sizes if n >= 100_000]
    assert paged_sizes
    assert paged.notes["paged_optimizer_bytes"] == sum(2 * n for n in paged_sizes)
    assert paged.held_bytes["optimizer_state"] == expected - sum(2 * n for n in paged_sizes)


def _model_parameters(script: Path) -> list[object]:
    namespace: dict[str, object] = {}
    source = SCRIPT.split("mode, batch")[0]
    exec(compile(source, str(script), "exec"), namespace)
    model = namespace["Model"]()  # type: ignore[operator]
    return list(model.parameters())


def test_max_is_exact(tmp_path: Path) -> None:
    script = _script(tmp_path)
    result = plan(PlanOptions(command=["python", str(script), "plain", "{B}"], capacity="64MiB", max="B=1..64",
                              out=str(tmp_path / "out")))  # fmt: skip
    best = result.max["B"]
    assert best is not None and 1 <= best < 64
    outcomes = {config.values["B"]: config.fits for config in result.configs}
    assert outcomes[best] is True and outcomes[best + 1] is False
    assert all(fits == (value <= best) for value, fits in outcomes.items())  # type: ignore[operator]
    assert result.recommended is not None and result.configs[result.recommended].values == {"B": best}


def run_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    return subprocess.run([sys.executable, "-m", "memlens", "plan", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=500)  # fmt: skip


def test_json_shape_and_the_snapshots_open_in_triage(tmp_path: Path) -> None:
    script = _script(tmp_path)
    completed = run_cli("--json", "--capacity", "40MiB", "--try", "ckpt", "--try", "expandable", "--vary", "B=2,16",
                        "--out", "out", "--", "python", str(script), "plain", "{B}", cwd=tmp_path)  # fmt: skip
    assert completed.returncode in (0, 1), completed.stderr[-3000:]
    payload = json.loads(completed.stdout)
    assert set(payload) >= {"configs", "recommended", "max"}
    assert len(payload["configs"]) == 6 and payload["configs"][0]["levers"] == []
    for config in payload["configs"]:
        assert set(config) >= {"levers", "values", "peak_allocated_bytes", "peak_reserved_bytes", "fits", "snapshot"}
        assert Path(config["snapshot"]).is_file()
        assert Path(config["snapshot"].replace(".pickle", ".memlens.json")).is_file()
    assert [c["values"] for c in payload["configs"][:2]] == [{"B": 2}, {"B": 16}]
    assert payload["max"] == {}
    fitting = [i for i, c in enumerate(payload["configs"]) if c["fits"]]
    assert (payload["recommended"] is None) == (not fitting)
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    triage = subprocess.run([sys.executable, "-m", "memlens", "triage", "--json", payload["configs"][1]["snapshot"]],
                            env=env, capture_output=True, text=True, timeout=200)  # fmt: skip
    assert triage.returncode == 0, triage.stderr[-2000:]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--try", "ckpt+sac"], "ckpt and sac cannot be combined"),
        (["--try", "flash"], "unknown lever 'flash'"),
        (["--vary", "B=1,2"], r"has no \{B\}"),
        (["--max", "B=8..2"], "LO is above HI"),
        (["--gpu", "nosuchgpu"], "nosuchgpu"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path: Path, args: list[str], message: str) -> None:
    script = _script(tmp_path)
    completed = run_cli(*args, "--", "python", str(script), "plain", "2", cwd=tmp_path)
    assert completed.returncode == 2, completed.stderr
    lines = completed.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("memlens: error:"), completed.stderr
    import re

    assert re.search(message, lines[0]), lines[0]


def test_a_lever_with_nothing_to_act_on_is_reported_not_pretended(tmp_path: Path) -> None:
    script = tmp_path / "flat.py"
    script.write_text(textwrap.dedent("""
        import torch
        model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64)).cuda()
        model(torch.randn(4, 64, device="cuda")).sum().backward()
    """))  # fmt: skip
    result = plan(PlanOptions(command=["python", str(script)], tries=["ckpt", "optim=sgd"], out=str(tmp_path / "out")))
    baseline, ckpt, sgd = result.configs
    assert baseline.fits and not ckpt.fits and not sgd.fits
    assert "not applied: ckpt: the model holds no nn.ModuleList" in (ckpt.problem or "")
    assert "no torch.optim optimizer" in (sgd.problem or "")
    assert result.recommended == 0


def test_out_is_never_written_over(tmp_path: Path) -> None:
    script = _script(tmp_path)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "theirs.txt").write_text("x")
    completed = run_cli("--out", "out", "--", "python", str(script), "plain", "2", cwd=tmp_path)
    assert completed.returncode == 2 and "not empty" in completed.stderr
    assert (tmp_path / "out" / "theirs.txt").read_text() == "x"


def test_when_nothing_fits_the_plan_says_where_it_ran_out(tmp_path: Path) -> None:
    script = tmp_path / "small.py"
    script.write_text("import sys, torch\ntorch.empty(int(sys.argv[1]) << 20, dtype=torch.uint8, device='cuda')\n")
    completed = run_cli("--capacity", "1MiB", "--max", "B=1..4", "--out", "out", "--", "python", str(script), "{B}",
                        cwd=tmp_path)  # fmt: skip
    assert completed.returncode == 1, completed.stdout[-2000:] + completed.stderr[-2000:]
    out_of_memory = f"OUT OF MEMORY at {script}:2: aten.empty.memory_format asked for 1.00 MiB"
    assert f"largest B that fits, baseline: none (not even the lowest value fits: B=1 {out_of_memory})" in (
        completed.stdout
    )
    assert f"  0: {out_of_memory}" in completed.stdout


def test_a_second_plan_into_the_default_out_gets_a_fresh_folder(tmp_path: Path) -> None:
    script = tmp_path / "small.py"
    script.write_text("import torch\ntorch.nn.Linear(64, 64).cuda()(torch.randn(4, 64, device='cuda')).sum()\n")
    for folder in ("memlens_plan", "memlens_plan-2"):
        completed = run_cli("--", "python", str(script), cwd=tmp_path)
        assert completed.returncode == 0, completed.stdout[-2000:] + completed.stderr[-2000:]
        assert f"snapshots under {tmp_path / folder} " in completed.stdout
        assert (tmp_path / folder / "00-baseline" / "predicted.pickle").is_file()


FSDP_SCRIPT = textwrap.dedent(
    """
    import sys
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    class Block(nn.Module):
        def __init__(self, d):
            super().__init__()
            self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        def forward(self, x):
            return x + self.down(torch.relu(self.up(x)))

    class Model(nn.Module):
        def __init__(self, d=256, n=4):
            super().__init__()
            self.blocks = nn.ModuleList(Block(d) for _ in range(n))
        def forward(self, x):
            for block in self.blocks:
                x = block(x)
            return x

    own = sys.argv[1] == "own"
    if own:  # as a torchrun script does: its own process group and fully_shard
        dist.init_process_group("nccl")
    model = Model().cuda()
    if own:
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters())
    for _ in range(2):
        model(torch.randn(8, 256, device="cuda")).sum().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    assert dist.get_world_size() == 8
    """
)


def test_fsdp_at_world_size_n_holds_the_sharded_state(tmp_path: Path) -> None:
    """One rank of 8, from one process, under the fake process group: after the steps each rank
    holds 4P/N of parameters and 8P/N of AdamW state (12P/N), whether the script shards itself
    or ``fsdp`` is applied from outside; both predict the same peak."""
    script = tmp_path / "train_fsdp.py"
    script.write_text(FSDP_SCRIPT)
    options = PlanOptions(command=["python", str(script), "{M}"], world_size=8, out=str(tmp_path / "out"))
    configurations = [
        Configuration(values={"M": "own"}),
        Configuration(levers=parse_spec("fsdp"), values={"M": "plain"}),
        Configuration(levers=parse_spec("fsdp+offload=params"), values={"M": "plain"}),
    ]
    own, lever, offloaded = predict_configurations(options, configurations)
    # With FSDP2's CPU offload the shards and the optimizer state stay on the CPU.
    assert offloaded.fits and offloaded.held_bytes == {"parameters": 0, "gradients": 0, "optimizer_state": 0}
    assert offloaded.peak_allocated_bytes < lever.peak_allocated_bytes
    parameters = 4 * (256 * 1024 * 2 + 1024 + 256)
    for config in (own, lever):
        assert config.fits, config.problem
        held = config.held_bytes
        assert _close(held["parameters"], 4 * parameters // 8, 0.03), held
        assert _close(held["parameters"] + held["optimizer_state"], 12 * parameters // 8, 0.03), held
    assert lever.notes["fsdp"] == {"world_size": 8, "units": 5, "cpu_offload": False}
    sidecar = json.loads(Path(str(lever.snapshot).replace(".pickle", ".memlens.json")).read_text())
    assert (sidecar["rank"], sidecar["world_size"]) == (0, 8)
    assert _close(own.peak_allocated_bytes, lever.peak_allocated_bytes, 0.01), (own, lever)
    # PyTorch's FSDPMemTracker on the same model, sharded the same way over 8 fake ranks on the
    # CPU (where it runs without a GPU): the same sharded parameters and optimizer state (its
    # state also counts AdamW's step counts, which stay on the CPU in a CUDA run: 4 bytes each).
    tracked = json.loads(subprocess.run([sys.executable, "-c", MEMTRACKER], capture_output=True, text=True,
                                        timeout=300, check=True).stdout)  # fmt: skip
    steps = 4 * 4 * 4  # one 4-byte count per parameter tensor: 4 blocks of 4
    assert own.held_bytes["parameters"] == lever.held_bytes["parameters"] == tracked["SHARDED_PARAM"]
    assert own.held_bytes["optimizer_state"] == lever.held_bytes["optimizer_state"] == tracked["OPT"] - steps


MEMTRACKER = FSDP_SCRIPT.split("own = sys.argv")[0] + textwrap.dedent(
    """
    import json
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
    mesh = init_device_mesh("cpu", (8,))
    model = Model()
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters())
    tracker = FSDPMemTracker(model, optimizer)
    with tracker:
        for _ in range(2):
            model(torch.randn(8, 256)).sum().backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    stats = tracker.get_tracker_snapshot()[torch.device("cpu")]
    print(json.dumps({str(key).rsplit(".", 1)[-1]: value for key, value in stats.items()}))
    """
)


DDP_SCRIPT = textwrap.dedent(
    """
    import sys
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    class Block(nn.Module):
        def __init__(self, d):
            super().__init__()
            self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        def forward(self, x):
            return x + self.down(torch.relu(self.up(x)))

    class Model(nn.Module):
        def __init__(self, d=512, n=6):
            super().__init__()
            self.blocks = nn.ModuleList(Block(d) for _ in range(n))
        def forward(self, x):
            for block in self.blocks:
                x = block(x)
            return x

    mode = sys.argv[1]
    if mode != "plain":  # as a torchrun script does
        dist.init_process_group("nccl")
        torch.cuda.set_device(dist.get_rank())
    model = Model().cuda()
    if mode == "ddp":
        model = DDP(model, device_ids=[0])
    elif mode == "view":
        model = DDP(model, device_ids=[0], gradient_as_bucket_view=True)
    elif mode == "hook":  # a comm hook of the user's: reads its allreduce's future, fp16 copies
        model = DDP(model, device_ids=[0], bucket_cap_mb=5)
        model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif mode == "unused":
        model = DDP(model, device_ids=[0], find_unused_parameters=True)
    optimizer = torch.optim.AdamW(model.parameters())
    for _ in range(3):  # the buckets are rebuilt in the order gradients come, before the second step
        model(torch.randn(8, 512, device="cuda")).sum().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    assert mode == "plain" or dist.get_world_size() == 4
    """
)


def test_ddp_at_world_size_n_holds_its_gradient_buckets(tmp_path: Path) -> None:
    """A DDP script as one rank of 4 (``memlens plan --world-size 4``): DDP's reducer runs as it
    does on a GPU, and its gradient buckets (a copy of every gradient, one flat tensor per bucket)
    are what the DDP run holds over the same script without DDP; with ``gradient_as_bucket_view``
    the gradients are the buckets (no more than without DDP). A comm hook of the user's reads its
    collective's future. The options the reducer cannot run without a GPU say so in one line."""
    script = tmp_path / "train_ddp.py"
    script.write_text(DDP_SCRIPT)
    completed = run_cli("--json", "--world-size", "4", "--capacity", "8GiB", "--vary", "M=plain,ddp,view,hook,unused",
                        "--out", "out", "--", "python", str(script), "{M}", cwd=tmp_path)  # fmt: skip
    assert completed.returncode == 0, completed.stderr[-3000:]
    configs = {config["values"]["M"]: config for config in json.loads(completed.stdout)["configs"]}
    for mode in ("plain", "ddp", "view", "hook"):
        assert configs[mode]["fits"], (mode, configs[mode]["problem"])
    gradient_bytes = 4 * 6 * (512 * 2048 * 2 + 2048 + 512)  # fp32: the parameters' bytes
    plain = configs["plain"]["peak_allocated_bytes"]
    for mode in ("ddp", "hook"):
        buckets = configs[mode]["peak_allocated_bytes"] - plain
        assert _close(buckets, gradient_bytes, 0.02), (mode, buckets, gradient_bytes)
    assert _close(configs["view"]["peak_allocated_bytes"], plain, 0.01), (configs["view"], plain)
    unused = configs["unused"]
    assert not unused["fits"] and "find_unused_parameters=True is not supported" in unused["problem"]
    assert "INTERNAL ASSERT" not in unused["problem"]
    sidecar = json.loads(Path(str(configs["ddp"]["snapshot"]).replace(".pickle", ".memlens.json")).read_text())
    assert (sidecar["rank"], sidecar["world_size"]) == (0, 4)


def test_plan_stacks_name_only_the_scripts_code_and_torchs(tmp_path: Path) -> None:
    """``plan --stacks`` never attributes memory to memlens' own code (issue 36: its child.py,
    which runs the script, appeared in the stacks)."""
    import pickle

    script = _script(tmp_path)
    completed = run_cli("--json", "--stacks", "--capacity", "1GiB", "--out", "out", "--",
                        "python", str(script), "plain", "2", cwd=tmp_path)  # fmt: skip
    assert completed.returncode == 0, completed.stderr[-3000:]
    snapshot = json.loads(completed.stdout)["configs"][0]["snapshot"]
    with open(snapshot, "rb") as file:
        written = pickle.load(file)  # memlens' own file, written just now
    files = {frame["filename"] for trace in written["device_traces"] for entry in trace for frame in entry["frames"]}
    assert str(script) in files  # the stacks were recorded, down to the script's lines
    package = str(REPO_ROOT / "memlens")
    assert not [name for name in files if name.startswith(package)], sorted(files)
