"""Optimizer spike: persistent state vs transient temporaries, from annotations or frames."""

from __future__ import annotations

from memlens.analysis import Finding, Report, analyze
from tests.unit.tracebuilder import BACKWARD, MODEL, OPTIM, OPTIM_WINDOWS, MiB, TraceBuilder, frame, training_run

ZERO_GRAD = [
    frame("zero_grad", "/venv/site-packages/torch/optim/optimizer.py", 1062),
    frame("train", "/work/proj/train.py", 45),
]


def _spike(report: Report) -> Finding | None:
    found = [f for f in report.findings if f.kind == "optimizer_spike"]
    assert len(found) <= 1
    return found[0] if found else None


def test_first_step_state_is_persistent_and_later_temps_transient() -> None:
    report = analyze(training_run(3, params=(64 * MiB,) * 4, optimizer_temps=32 * MiB).snapshot())
    spike = _spike(report)
    assert spike is not None
    windows = report.device(0).optimizer_windows
    assert (spike.start_event, spike.end_event) == windows[0]  # the first step makes the state
    assert spike.evidence["new_state_bytes"] == 8 * 64 * MiB  # two moments per parameter
    assert spike.evidence["transient_bytes"] == 2 * 32 * MiB  # two foreach buffers at once
    assert spike.evidence["transient_peak_bytes"] == 2 * 32 * MiB
    assert spike.evidence["released_bytes"] == 0
    assert spike.bytes == spike.evidence["spike_bytes"] == (8 * 64 + 2 * 32) * MiB
    assert spike.evidence["windows"] == 3
    assert spike.top_stacks[0].frames[0].startswith("train (/work/proj/train.py")


def test_eight_p_comparison_uses_the_sidecar_parameter_count() -> None:
    snapshot = training_run(2, params=(64 * MiB,) * 4).snapshot(sidecar={"model": {"parameters": 64 * MiB}})
    spike = _spike(analyze(snapshot))
    assert spike is not None
    assert spike.evidence["parameters_source"] == "sidecar"
    assert spike.evidence["adam_state_8p_bytes"] == 8 * 64 * MiB
    assert spike.evidence["new_state_bytes"] == 8 * 64 * MiB


def test_window_from_optimizer_frames_on_windows_paths() -> None:
    builder = training_run(
        2, params=(64 * MiB,) * 4, markers="none", annotate_optimizer=False, optimizer_frames=OPTIM_WINDOWS
    )
    report = analyze(builder.snapshot())
    spike = _spike(report)
    assert spike is not None
    assert spike.evidence["window_source"] == "frames"
    assert spike.evidence["new_state_bytes"] == 8 * 64 * MiB


def test_no_optimizer_no_finding() -> None:
    b = TraceBuilder()
    acts = [b.alloc(64 * MiB) for _ in range(4)]
    for address in acts:
        b.free(address)
    assert _spike(analyze(b.snapshot())) is None


def test_tiny_optimizer_is_not_a_finding() -> None:
    report = analyze(training_run(3, params=(1 * MiB,), optimizer_temps=64 * 1024).snapshot())
    assert _spike(report) is None


def _adds_up(spike: Finding) -> bool:
    e = spike.evidence
    return int(e["spike_bytes"]) == int(e["new_state_bytes"]) + int(e["transient_bytes"]) - int(e["released_bytes"])


def test_the_spike_adds_up_to_the_byte_in_the_json_and_names_its_moment() -> None:
    report = analyze(training_run(3, params=(64 * MiB,) * 4, optimizer_temps=32 * MiB).snapshot())
    spike = _spike(report)
    assert spike is not None and _adds_up(spike)
    (as_json,) = [f for f in report.to_json()["devices"]["0"]["findings"] if f["kind"] == "optimizer_spike"]
    e = {item["name"]: item["value"] for item in as_json["evidence"]}
    assert e["spike_bytes"] == e["new_state_bytes"] + e["transient_bytes"] - e["released_bytes"]
    assert as_json["evidence"][0] == {"name": "spike_bytes", "value": e["spike_bytes"], "unit": "bytes",
                                      "meaning": "amount"}
    snapshot_trace = training_run(3, params=(64 * MiB,) * 4, optimizer_temps=32 * MiB).snapshot().device(0)
    row = int(spike.evidence["spike_event"])
    assert spike.evidence["level_at_spike_bytes"] == int(snapshot_trace.allocated[row])
    assert spike.evidence["level_before_bytes"] == int(snapshot_trace.allocated[spike.start_event - 1])
    assert spike.evidence["spike_us"] == int(snapshot_trace.time_us[row])
    assert spike.evidence["step"] == 1


def _frames_loop(zero_grad_after_step: bool) -> TraceBuilder:
    """Two steps found by torch/optim frames only: forward, backward (grads), optimizer.step
    (state on the first), then optimizer.zero_grad() freeing the grads right after the step."""
    b = TraceBuilder()
    params = [b.ghost(64 * MiB, MODEL) for _ in range(4)]
    state: list[int] = []
    for _ in range(2):
        acts = [b.alloc(64 * MiB, MODEL) for _ in range(4)]
        for address in acts:
            b.free(address)
        grads = [b.alloc(64 * MiB, BACKWARD) for _ in params]
        if not state:
            state.extend(b.alloc(64 * MiB, OPTIM) for _ in params for _ in range(2))
        temp = b.alloc(16 * MiB, OPTIM)
        b.free(temp)
        if zero_grad_after_step:
            for address in grads:
                b.trace.append(b._entry("free_requested", address, 64 * MiB, ZERO_GRAD))
                b.trace.append(b._entry("free_completed", address, 64 * MiB, ZERO_GRAD))
                b.live.pop(address)
    return b


def test_the_window_stops_at_zero_grad() -> None:
    report = analyze(_frames_loop(zero_grad_after_step=True).snapshot())
    device = report.device(0)
    assert device.optimizer_window_source == "frames"
    spike = _spike(report)
    assert spike is not None
    first_window = device.optimizer_windows[0]
    # The window holds the state and the temporary only: the grads' frees are not "state replaced".
    assert spike.evidence["state_kept_after_window_bytes"] == 8 * 64 * MiB
    assert spike.evidence["state_replaced_bytes"] == 0
    assert spike.evidence["released_bytes"] == 0
    assert spike.evidence["new_state_bytes"] == 8 * 64 * MiB
    assert _adds_up(spike)
    assert first_window[1] - first_window[0] == 8 + 1 + 2  # 8 state allocs, 1 temp alloc, its 2 free rows


def test_state_replaced_out_of_place_is_released_and_still_adds_up() -> None:
    b = TraceBuilder()
    params = [b.ghost(64 * MiB, MODEL) for _ in range(2)]
    state: dict[int, list[int]] = {}
    for step in (1, 2, 3):
        with b.scope(f"memlens.step#{step}"):
            acts = [b.alloc(64 * MiB, MODEL) for _ in range(4)]
            for address in reversed(acts):
                b.free(address)
            with b.scope("Optimizer.step#Custom.step"):
                for p in range(len(params)):  # new moments for each parameter, then the old ones go
                    fresh = [b.alloc(64 * MiB, OPTIM) for _ in range(2)]
                    for address in state.get(p, []):
                        b.free(address)
                    state[p] = fresh
                if step >= 2:  # a buffer the later steps need
                    b.free(b.alloc(512 * MiB, OPTIM))
    report = analyze(b.snapshot())
    spike = _spike(report)
    assert spike is not None and _adds_up(spike)
    assert spike.step == 2
    assert spike.evidence["new_state_bytes"] == 4 * 64 * MiB
    assert spike.evidence["released_bytes"] == 4 * 64 * MiB  # the old moments, freed before the buffer
    assert spike.evidence["transient_bytes"] == 512 * MiB
    assert spike.evidence["spike_bytes"] == 512 * MiB
    assert spike.evidence["state_replaced_bytes"] == 4 * 64 * MiB
