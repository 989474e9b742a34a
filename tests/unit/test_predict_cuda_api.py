"""The emulated ``torch.cuda`` surface of ``memlens predict``, one call at a time, each checked
against what the caching-allocator simulator holds."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch
import torch.optim.optimizer as optimizer_module

from memlens.predict import PredictSession, predict
from memlens.predict.gpus import GPUS, default_cublas_workspace_bytes
from memlens.predict.sdpa import EFFICIENT_ATTENTION, FLASH_ATTENTION, MATH, choose_sdpa_backend
from memlens.snapshot.reader import load

pytestmark = pytest.mark.timeout(120)
MiB = 1 << 20


@pytest.fixture
def session():
    with PredictSession(gpu="a100-80gb") as active:
        yield active
    active.close()


def test_device_queries_describe_the_named_gpu(session: PredictSession) -> None:
    spec = GPUS["a100-80gb"]
    assert torch.cuda.is_available() is True
    assert torch.cuda.device_count() == 1
    assert torch.cuda.current_device() == 0
    assert torch.cuda.get_device_name() == spec.name
    assert torch.cuda.get_device_capability() == (8, 0)
    properties = torch.cuda.get_device_properties(0)
    assert (properties.name, properties.total_memory) == (spec.name, spec.total_memory)
    assert torch.cuda.is_bf16_supported()


def test_cuda_tensors_are_fake_with_exact_metadata(session: PredictSession) -> None:
    x = torch.empty(3, 5, device="cuda", dtype=torch.float16)
    assert x.device == torch.device("cuda", 0)
    assert (x.shape, x.dtype, x.stride()) == ((3, 5), torch.float16, (5, 1))
    moved = torch.zeros(7).to("cuda")
    assert moved.is_cuda


def test_memory_allocated_is_the_simulators_rounded_blocks(session: PredictSession) -> None:
    before = torch.cuda.memory_allocated()
    assert before == session.simulator.allocated_bytes
    x = torch.empty(1000, device="cuda", dtype=torch.uint8)  # rounded to 1024 like the real allocator
    assert torch.cuda.memory_allocated() - before == 1024 == session.simulator.round_size(1000)
    assert torch.cuda.memory_allocated() == session.simulator.allocated_bytes
    del x
    assert torch.cuda.memory_allocated() == before


def test_views_share_their_base_allocation(session: PredictSession) -> None:
    x = torch.empty(4 * MiB, device="cuda", dtype=torch.uint8)
    allocated = torch.cuda.memory_allocated()
    view = x.view(2, -1)[1]
    assert torch.cuda.memory_allocated() == allocated
    del x
    assert torch.cuda.memory_allocated() == allocated  # the view keeps the storage alive
    del view
    assert torch.cuda.memory_allocated() == allocated - 4 * MiB


def test_reserved_stays_cached_until_empty_cache(session: PredictSession) -> None:
    x = torch.empty(30 * MiB, device="cuda", dtype=torch.uint8)
    reserved = torch.cuda.memory_reserved()
    assert reserved == session.simulator.reserved_bytes >= 30 * MiB
    del x
    assert torch.cuda.memory_reserved() == reserved  # the caching allocator keeps the segment
    torch.cuda.empty_cache()
    assert torch.cuda.memory_reserved() == session.simulator.reserved_bytes == reserved - 30 * MiB


def test_peaks_and_their_reset(session: PredictSession) -> None:
    x = torch.empty(8 * MiB, device="cuda", dtype=torch.uint8)
    del x
    assert torch.cuda.max_memory_allocated() == session.simulator.peak_allocated_bytes >= 8 * MiB
    assert torch.cuda.max_memory_reserved() == session.simulator.peak_reserved_bytes
    torch.cuda.reset_peak_memory_stats()
    assert torch.cuda.max_memory_allocated() == torch.cuda.memory_allocated()
    assert torch.cuda.max_memory_reserved() == torch.cuda.memory_reserved()
    assert session.tracker.peak_allocated_bytes >= 8 * MiB  # the whole-run peak is kept apart


def test_mem_get_info_and_memory_stats(session: PredictSession) -> None:
    x = torch.empty(12 * MiB, device="cuda", dtype=torch.uint8)
    free, total = torch.cuda.mem_get_info()
    assert total == GPUS["a100-80gb"].total_memory
    assert free == total - session.simulator.reserved_bytes
    stats = torch.cuda.memory_stats()
    assert stats["allocated_bytes.all.current"] == session.simulator.allocated_bytes
    assert stats["reserved_bytes.all.current"] == session.simulator.reserved_bytes
    assert stats["num_device_alloc"] == session.simulator.segment_alloc_count
    del x


def test_reserve_outside_comes_off_the_capacity() -> None:
    with PredictSession(gpu="l4", reserve_outside=2 << 30) as active:
        free, total = torch.cuda.mem_get_info()
        assert total == GPUS["l4"].total_memory
        assert free == total - (2 << 30)
        assert active.simulator.capacity == total - (2 << 30)
    active.close()


def test_streams_events_and_synchronize_run(session: PredictSession) -> None:
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        torch.empty(10, device="cuda")
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    end.record()
    torch.cuda.synchronize()
    assert start.elapsed_time(end) == 0.0
    assert torch.cuda.current_stream() == torch.cuda.default_stream()


def test_cublas_workspace_per_thread_sized_for_the_gpu() -> None:
    for key in ("a100-80gb", "h100-80gb"):
        with PredictSession(gpu=key) as active:
            a = torch.empty(64, 64, device="cuda")
            before = torch.cuda.memory_allocated()
            out = a @ a
            workspace = default_cublas_workspace_bytes(GPUS[key])
            assert torch.cuda.memory_allocated() - before == workspace + active.simulator.round_size(64 * 64 * 4)
            out2 = a @ a  # the same thread reuses its workspace
            assert torch.cuda.memory_allocated() - before == workspace + 2 * active.simulator.round_size(64 * 64 * 4)
            del out, out2
        active.close()
    assert default_cublas_workspace_bytes(GPUS["a100-80gb"]) == 8_519_680
    assert default_cublas_workspace_bytes(GPUS["h100-80gb"]) == 32 << 20


def test_history_snapshot_and_dump(session: PredictSession, tmp_path: Path) -> None:
    early = torch.empty(3 * MiB, device="cuda", dtype=torch.uint8)
    torch.cuda.memory._record_memory_history(max_entries=100)
    late = torch.empty(5 * MiB, device="cuda", dtype=torch.uint8)
    snapshot = torch.cuda.memory._snapshot()
    trace = snapshot["device_traces"][0]
    assert [entry["action"] for entry in trace if entry["action"] == "alloc"] == ["alloc"]
    assert trace[-1]["size"] == 5 * MiB
    assert any(frame["filename"] == __file__ for frame in trace[-1]["frames"])
    live = sum(
        block["size"] for seg in snapshot["segments"] for block in seg["blocks"] if block["state"] == "active_allocated"
    )
    assert live == session.simulator.allocated_bytes
    path = tmp_path / "dump.pickle"
    torch.cuda.memory._dump_snapshot(str(path))
    assert str(path.resolve()) in session.snapshot_paths
    loaded = load(path, cache=False)
    assert len(loaded.device()) == len(trace)
    torch.cuda.memory._record_memory_history(enabled=None)
    assert torch.cuda.memory._snapshot()["device_traces"][0] == []
    with open(path, "rb") as handle:
        assert pickle.load(handle)["segments"]
    del early, late


def test_oom_is_raised_at_capacity_and_located() -> None:
    def too_big() -> None:
        keep = torch.empty(600 * MiB, device="cuda", dtype=torch.uint8)
        torch.empty(600 * MiB, device="cuda", dtype=torch.uint8)  # the line that does not fit
        del keep

    result = predict(too_big, capacity="1GiB")
    assert result.oom
    assert result.oom_at is not None and result.oom_at.startswith(__file__)
    assert result.snapshot is not None
    assert any(entry["action"] == "oom" for entry in result.snapshot["device_traces"][0])


def test_data_dependent_value_stops_with_the_line() -> None:
    def needs_value() -> float:
        loss = torch.ones(3, device="cuda").sum()
        return loss.item()

    result = predict(needs_value)
    assert not result.completed
    assert result.stopped_at is not None and result.stopped_at.startswith(__file__)
    assert "real value" in (result.stop_reason or "")


def test_training_step_autocast_and_foreach_optimizer() -> None:
    def step() -> tuple[torch.dtype, bool]:
        model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 8)).to("cuda")
        optimizer = torch.optim.AdamW(model.parameters())
        x = torch.randn(32, 256).cuda()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(x)
        out.float().sum().backward()
        _, foreach = optimizer_module._default_to_fused_or_foreach(list(model.parameters()), False)
        optimizer.step()
        assert all(p.grad is not None and p.grad.is_cuda for p in model.parameters())
        return out.dtype, foreach

    result = predict(step)
    assert result.completed
    assert result.value == (torch.bfloat16, True)
    params = (256 * 512 + 512 + 512 * 8 + 8) * 4
    assert result.peak_allocated_bytes >= 4 * params  # weights, grads, exp_avg, exp_avg_sq


def test_sdpa_backend_follows_gpu_and_dtype() -> None:
    q16 = torch.empty(2, 4, 128, 64, device="meta", dtype=torch.bfloat16)
    q32 = torch.empty(2, 4, 128, 64, device="meta", dtype=torch.float32)
    assert choose_sdpa_backend(GPUS["a100-80gb"], (q16, q16, q16), {}) == FLASH_ATTENTION
    assert choose_sdpa_backend(GPUS["a100-80gb"], (q32, q32, q32), {}) == EFFICIENT_ATTENTION
    h16 = torch.empty(2, 4, 128, 64, device="meta", dtype=torch.float16)
    assert choose_sdpa_backend(GPUS["v100-16gb"], (h16, h16, h16), {}) == EFFICIENT_ATTENTION
    assert choose_sdpa_backend(GPUS["v100-16gb"], (q16, q16, q16), {}) == MATH
    odd = torch.empty(2, 4, 128, 30, device="meta", dtype=torch.float16)
    assert choose_sdpa_backend(GPUS["a100-80gb"], (odd, odd, odd), {}) == MATH


def test_flash_attention_keeps_no_seq_by_seq_matrix() -> None:
    def attend() -> int:
        q = torch.empty(1, 8, 4096, 64, device="cuda", dtype=torch.bfloat16)
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        out = torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
        del out
        return torch.cuda.max_memory_allocated() - before

    result = predict(attend)
    assert result.completed
    assert result.value < 8 * 4096 * 4096 * 2  # no attention matrix, as flash attention on the GPU


def test_everything_is_restored_after_the_session() -> None:
    with PredictSession() as active:
        assert torch.cuda.is_available()
    active.close()
    assert torch.cuda.is_available() is False
    assert torch.ones(2).sum().item() == 2.0


def _log_softmax(x: torch.Tensor) -> torch.Tensor:
    x = x - torch.max(x, dim=-1, keepdim=True)[0]
    return x - torch.log(torch.sum(torch.exp(x), dim=-1, keepdim=True))


def test_backward_works_in_place_where_the_gpu_does() -> None:
    """The CS336 cross-entropy's backward on a real GPU (the MAGMA27 trace) allocates six
    logit-sized blocks: gather's zeros (scattered into in place), three negations, exp's
    product, max's zeros (scattered into in place); the two gradient sums are in place. Fakes
    take the out-of-place road in all four places; the prediction must not count them."""

    def step() -> int:
        logits = torch.empty(8, 64, 1000, device="cuda", requires_grad=True)
        targets = torch.zeros(8, 64, dtype=torch.long, device="cuda")
        loss = torch.mean(torch.gather(-_log_softmax(logits), -1, targets.unsqueeze(-1)))
        before = len(active.simulator.trace)
        loss.backward()
        active.tracker.drain()
        size = logits.numel() * 4
        return sum(1 for e in active.simulator.trace[before:] if e["action"] == "alloc" and e["size"] == size)

    with PredictSession(stacks=False) as active:
        count = step()
    active.close()
    assert count == 6


_KEPT: list[torch.Tensor] = []


class _ScatterKeepingItsInput(torch.autograd.Function):
    @staticmethod
    def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:
        return x * 1

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:
        base = torch.zeros_like(grad)
        _KEPT.append(base)  # still referenced: no in-place reuse on a GPU either
        return base.scatter(0, torch.zeros_like(grad, dtype=torch.long), grad)


def test_out_of_place_stays_out_of_place_when_the_input_lives_on() -> None:
    with PredictSession(stacks=False) as active:
        x = torch.empty(256, 1024, device="cuda", requires_grad=True)
        y = _ScatterKeepingItsInput.apply(x)
        before = len(active.simulator.trace)
        y.backward(torch.empty_like(y))
        active.tracker.drain()
        sizes = [e["size"] for e in active.simulator.trace[before:] if e["action"] == "alloc"]
        _KEPT.clear()
    active.close()
    # x * 1's backward (grad * 1), the zeros, and the scatter's own result beside them.
    assert sizes.count(256 * 1024 * 4) == 3


def test_the_package_is_the_function() -> None:
    import memlens.predict

    result = memlens.predict(lambda: torch.empty(1000, device="cuda"), capacity="1GiB")
    assert result.capacity_bytes == 1 << 30
    assert result.peak_allocated_bytes == 4096  # 4000 bytes, rounded up to a multiple of 512
    assert set(result.to_json()) >= {"peak_allocated_bytes", "peak_reserved_bytes", "oom", "snapshots"}


def test_placeholder_values_stand_in_and_are_counted() -> None:
    def step() -> tuple[float, int, bool, list[float]]:
        x = torch.ones(3, device="cuda")
        return x.sum().item(), int(x.long().sum()), bool((x > 0).all()), x.tolist()

    result = predict(step, placeholder_values=True)
    assert result.completed
    loss, count, flag, values = result.value
    assert loss != loss and count == 0 and flag is False  # NaN, 0, False
    assert len(values) == 3 and all(v != v for v in values)
    assert result.placeholder_values == 6
    assert result.first_placeholder_at is not None and result.first_placeholder_at.startswith(__file__)


def test_alloc_conf_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    with PredictSession(stacks=False) as active:
        x = torch.empty(30 * MiB, device="cuda", dtype=torch.uint8)
        assert active.settings.expandable_segments
        assert torch.cuda.memory_reserved() == active.simulator.reserved_bytes
        assert any(entry["action"] == "segment_map" for entry in active.simulator.trace)
        del x
    active.close()


@torch.library.custom_op("memlens_predict_test::no_fake", mutates_args=())
def _custom_kernel_without_fake(x: torch.Tensor) -> torch.Tensor:
    return x.clone()


@torch.library.custom_op("memlens_predict_test::with_fake", mutates_args=())
def _custom_kernel_with_fake(x: torch.Tensor) -> torch.Tensor:
    return torch.cat([x, x])


@_custom_kernel_with_fake.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return x.new_empty((2 * x.shape[0], *x.shape[1:]))


def test_a_custom_kernel_without_fake_stops_and_is_named() -> None:
    def step() -> None:
        x = torch.empty(1024, device="cuda")
        _custom_kernel_without_fake(x)

    result = predict(step)
    assert not result.completed
    assert result.stopped_at is not None and result.stopped_at.startswith(__file__)
    assert "memlens_predict_test.no_fake" in (result.stop_reason or "")


def test_a_custom_kernel_with_fake_is_sized() -> None:
    def step() -> int:
        x = torch.empty(1024, device="cuda")
        before = torch.cuda.memory_allocated()
        y = _custom_kernel_with_fake(x)
        return torch.cuda.memory_allocated() - before + 0 * y.numel()

    result = predict(step)
    assert result.completed and result.value == 2 * 1024 * 4


@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
def test_torch_compile_runs_the_model_eagerly() -> None:
    """Dynamo does not compile while a dispatch mode is on the stack: compiled code runs as
    eager code, and the prediction is the uncompiled program's memory."""

    def step(compiled: bool) -> int:
        model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256)).to("cuda")
        run = torch.compile(model) if compiled else model
        run(torch.empty(64, 256, device="cuda")).sum().backward()
        return torch.cuda.max_memory_allocated()

    eager, compiled = predict(step, False), predict(step, True)
    assert compiled.completed
    assert compiled.value == eager.value


def test_the_smaller_calls_scripts_make(session: PredictSession) -> None:
    torch.cuda.set_device(0)
    torch.cuda.manual_seed(0)
    torch.cuda.manual_seed_all(0)
    assert torch.cuda.is_initialized()
    with torch.cuda.device(0):
        x = torch.empty(2 * MiB, device="cuda", dtype=torch.uint8)
    assert torch.cuda.memory_cached() == torch.cuda.memory_reserved() == session.simulator.reserved_bytes
    assert torch.cuda.max_memory_cached() == session.simulator.peak_reserved_bytes
    torch.cuda.reset_max_memory_allocated()
    assert torch.cuda.max_memory_allocated() == session.simulator.allocated_bytes
    assert f"allocated_bytes.all.current: {session.simulator.allocated_bytes}" in torch.cuda.memory_summary()
    assert torch.cuda.memory.memory_allocated() == torch.cuda.memory_allocated()
    del x


def test_history_ring_buffer_keeps_the_newest_entries(session: PredictSession) -> None:
    torch.cuda.memory._record_memory_history(True, trace_alloc_max_entries=3)
    kept = [torch.empty(n * MiB, device="cuda", dtype=torch.uint8) for n in (1, 2, 3, 4, 5)]
    trace = torch.cuda.memory._snapshot()["device_traces"][0]
    assert len(trace) == 3
    assert trace[-1]["action"] == "alloc" and trace[-1]["size"] == 5 * MiB
    del kept
