"""The activation plateau by module: the recorder's ``memlens.forward#<module>`` scopes say which
forward allocated each activation still alive at the end of forward; the finding names the
repeated blocks holding the plateau and sets them against Megatron's per-layer count when the
sidecar gives the shapes."""

from __future__ import annotations

from typing import Any

from memlens.analysis import Finding, analyze
from memlens.budget.formulas import megatron_layer_activation_bytes
from tests.unit.tracebuilder import BACKWARD, MODEL, MiB, TraceBuilder, frame

HEAD = [frame("forward", "/work/proj/head.py", 7), frame("train", "/work/proj/train.py", 5)]


def _run(layers: list[int], head: int = 0, *, scopes: bool = True, outside: int = 0, steps: int = 2) -> TraceBuilder:
    """``steps`` marked steps of a model whose block i allocates ``layers[i]`` bytes in forward
    (half in its ``mlp`` child), a ``head`` after them and ``outside`` bytes outside any module;
    all freed through backward."""
    b = TraceBuilder()
    acts: list[int] = []

    def module(name: str, sizes: list[int], frames: list[dict[str, Any]]) -> None:
        if scopes:
            b.annotate(f"memlens.forward#{name}", "START")
        acts.extend(b.alloc(size, frames) for size in sizes)
        if scopes:
            b.annotate(f"memlens.forward#{name}", "END")

    for step in range(steps):
        with b.scope(f"memlens.step#{step}"):
            acts.clear()

            if scopes:
                b.annotate("memlens.forward#<root>", "START")
            for i, size in enumerate(layers):
                if scopes:
                    b.annotate(f"memlens.forward#layers.{i}", "START")
                acts.append(b.alloc(size // 2, MODEL))
                module(f"layers.{i}.mlp", [size - size // 2], MODEL)
                if scopes:
                    b.annotate(f"memlens.forward#layers.{i}", "END")
            if head:
                module("head", [head], HEAD)
            if scopes:
                b.annotate("memlens.forward#<root>", "END")
            if outside:
                acts.append(b.alloc(outside, MODEL))  # the loss, computed outside the model
            for address in reversed(acts):
                tmp = b.alloc(MiB, BACKWARD)
                b.free(address)
                b.free(tmp)
    return b


def _plateau(builder: TraceBuilder, sidecar: dict[str, Any] | None = None) -> Finding:
    (finding,) = [f for f in analyze(builder.snapshot(sidecar)).findings if f.kind == "activation_plateau"]
    return finding


def test_the_plateau_names_the_blocks_that_hold_it() -> None:
    finding = _plateau(_run([8 * MiB, 8 * MiB, 12 * MiB], head=4 * MiB, outside=2 * MiB))
    evidence = finding.evidence
    assert finding.bytes == 34 * MiB
    assert evidence["blocks"] == 3 and evidence["block_parent"] == "layers"
    assert evidence["block_bytes_min"] == 8 * MiB and evidence["block_bytes_max"] == 12 * MiB
    assert evidence["largest_block"] == "layers.2"
    assert evidence["per_block"] == "layers.0 8.00 MiB, layers.1 8.00 MiB, layers.2 12.00 MiB"
    assert evidence["other_modules"] == "head 4.00 MiB"
    assert evidence["activation_bytes_outside_modules"] == 2 * MiB
    assert evidence["activation_bytes_in_modules"] == 32 * MiB
    assert evidence["blocks_share_of_plateau"] == round(28 / 34, 3)
    assert "The 3 blocks `layers.0` ... `layers.2` hold 82% of it, 9.33 MiB each on average " \
           "(largest `layers.2`, 12.00 MiB)." in finding.summary
    assert "theory_per_layer_bytes" not in evidence  # the sidecar says nothing about shapes


def test_the_per_layer_theory_comes_from_the_sidecar_shapes() -> None:
    batch, seq, hidden, heads = 4, 128, 256, 8
    sidecar = {"model": {"parameter_bytes_by_dtype": {"torch.float32": 1 << 20},
                         "config": {"hidden_size": hidden, "num_attention_heads": heads},
                         "inputs": {"batch_size": batch, "seq_len": seq}}}
    finding = _plateau(_run([9 * MiB] * 4), sidecar)
    expected = megatron_layer_activation_bytes(batch, seq, hidden, None, flash_attention=True, bytes_scale=2.0)
    assert expected == 34 * batch * seq * hidden * 2  # fp32 activations: 4 bytes an element
    assert finding.evidence["theory_per_layer_bytes"] == expected
    assert finding.evidence["theory_per_layer_with_scores_bytes"] == expected + 5 * heads * seq * seq * batch * 2
    assert finding.evidence["theory_layers"] == 4
    assert "the per-layer theory gives 8.50 MiB (Megatron 34*B*T*d with B=4, T=128, d=256, fp32 activations)" \
        in finding.summary


def test_without_module_scopes_the_finding_is_as_before() -> None:
    finding = _plateau(_run([8 * MiB, 8 * MiB, 12 * MiB], scopes=False))
    assert "blocks" not in finding.evidence and "module_scopes" not in finding.evidence
    assert finding.summary.endswith("and are freed through backward.")


def test_without_repeated_blocks_the_top_level_modules_are_listed() -> None:
    finding = _plateau(_run([20 * MiB], head=6 * MiB))
    assert "blocks" not in finding.evidence
    assert finding.evidence["other_modules"] == "layers 20.00 MiB, head 6.00 MiB"
    assert "By module: layers 20.00 MiB, head 6.00 MiB." in finding.summary
