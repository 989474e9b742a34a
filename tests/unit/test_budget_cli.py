"""`memlens budget`: the command line over memlens.budget."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from memlens.cli.budget import budget
from memlens.cli.main import cli, main
from memlens.errors import MemlensUsageError
from memlens.ops.vocab import parse_capacity
from memlens.units import parse_count


def run(*args: str) -> str:
    result = CliRunner().invoke(cli, ["budget", *args])
    assert result.exit_code == 0, result.output + repr(result.exception)
    return result.output


def test_7b_adamw_bf16_mixed_prints_112_gb_static_total() -> None:
    out = run("--params", "7e9", "--optimizer", "adamw", "--precision", "bf16-mixed", "--units", "gb")
    static = next(line for line in out.splitlines() if line.startswith("static total"))
    assert "112.00 GB" in static
    assert "GB = 1e9 bytes" in out
    for name in (
        "weights",
        "gradients",
        "master_weights",
        "optimizer_state",
        "activations",
        "logits",
        "total",
    ):
        assert any(line.startswith(name) for line in out.splitlines()), name


def test_json_gives_the_line_items() -> None:
    payload = json.loads(run("--params", "7e9", "--optimizer", "adamw", "--precision", "bf16-mixed", "--json"))
    items = {item["name"]: item["bytes"] for item in payload["items"]}
    assert items["weights"] == 14 * 10**9 and items["optimizer_state"] == 56 * 10**9
    assert payload["static_bytes"] == 112 * 10**9


def test_gib_is_the_default_as_in_triage() -> None:
    """One unit across memlens: budget prints GiB like triage, and says so in its first line."""
    out = run("--params", "7e9")
    assert out.splitlines()[0].endswith("(GiB = 2**30 bytes)") and "104.31 GiB" in out
    assert run("--params", "7e9", "--gib") == out  # the old flag still works, as a no-op


def test_capacity_prints_fit_and_max_micro_batch() -> None:
    args = [
        "--hidden",
        "4096",
        "--layers",
        "32",
        "--heads",
        "32",
        "--vocab",
        "32000",
        "--ffn",
        "11008",
        "--lora-rank",
        "16",
        "--lora-targets",
        "q,k,v,o",
        "--qlora",
        "--seq",
        "2048",
        "--checkpointing",
        "full",
        "--capacity",
        "24GB",
        "--capacity",
        "80GiB",
    ]
    out = run(*args)
    # A capacity is echoed as written, with its size in the table's unit (24GB is 22.35 GiB).
    assert "fits 24GB (22.35 GiB): yes" in out and "fits 80GiB: yes" in out
    assert "largest micro-batch on 24GB (22.35 GiB):" in out and "limited by" in out
    assert "> 24GB (22.35 GiB);" in out  # the next batch's need in GiB, not raw bytes
    assert not re.search(r"\d{1,3}(,\d{3}){2,} B", out)  # no unformatted byte counts
    in_gb = run(*args, "--units", "gb")
    assert "fits 24GB: yes" in in_gb and "fits 80GiB (85.90 GB): yes" in in_gb
    payload = json.loads(run(*args, "--json"))
    small, big = payload["capacities"]
    assert small["capacity"] == "24GB" and small["capacity_bytes"] == 24 * 10**9
    assert 1 <= small["max_micro_batch"]["micro_batch"] < big["max_micro_batch"]["micro_batch"]


def test_every_input_flag_is_accepted(tmp_path: Path) -> None:
    config = tmp_path / "config.json"
    config.write_text(
        json.dumps(
            {
                "model_type": "llama",
                "hidden_size": 512,
                "num_hidden_layers": 4,
                "num_attention_heads": 8,
                "num_key_value_heads": 2,
                "vocab_size": 1000,
                "intermediate_size": 1024,
            }
        )
    )
    out = run(
        "--config",
        str(config),
        "--precision",
        "fp16-mixed",
        "--optimizer",
        "galore",
        "--galore-rank",
        "32",
        "--optim-dtype",
        "bf16",
        "--grad-dtype",
        "fp32",
        "--batch",
        "4",
        "--seq",
        "256",
        "--grad-accum",
        "4",
        "--checkpointing",
        "every:2",
        "--no-flash-attn",
        "--activations",
        "megatron",
        "--chunked-loss",
        "8",
        "--zero",
        "3",
        "--world-size",
        "4",
        "--offload-optimizer",
        "--offload-params",
        "--capacity",
        "1GB",
    )
    assert "checkpointing every:2" in out and "on the host" in out
    out = run(
        "--params",
        "1B",
        "--hidden",
        "2048",
        "--layers",
        "16",
        "--vocab",
        "32000",
        "--ffn",
        "5504",
        "--frozen-layers",
        "8",
        "--tie-embeddings",
        "--optimizer",
        "sgd-momentum",
    )
    assert "static total" in out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--params", "seven"], "not a parameter count"),
        (["--params", "7e9", "--precision", "fp8"], "unknown precision"),
        (["--params", "7e9", "--qlora"], "LoRA rank"),
        (["--params", "7e9", "--checkpointing", "every:x"], "every:K"),
        (["--params", "7e9", "--capacity", "lots"], "not a byte size"),
        (["--config", "x.json", "--hidden", "8"], "config gives the sizes"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    result = CliRunner().invoke(budget, args)
    assert isinstance(result.exception, MemlensUsageError)
    assert message in str(result.exception)
    with pytest.raises(SystemExit) as exited:
        main(["budget", *args])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err


def test_help_is_the_module_docstring() -> None:
    result = CliRunner().invoke(cli, ["budget", "--help"])
    assert result.exit_code == 0 and "Estimate the memory a training step needs" in result.output


def test_parsers() -> None:
    assert parse_count("7e9") == parse_count("7B") == 7_000_000_000
    assert parse_count("350M") == 350_000_000
    assert parse_capacity("80GiB") == 80 * 2**30
    assert parse_capacity("80GB") == 80 * 10**9
    assert parse_capacity("24GiB") == 24 * 2**30


def test_architecture_without_ffn_assumes_4d_and_says_so() -> None:
    out = run("--hidden", "768", "--layers", "12", "--heads", "12", "--vocab", "32000", "--seq", "1024")
    # 12 layers of 4d^2 attention + 8d^2 MLP (d -> 4d -> d), two norms each, the final norm and an
    # untied embedding and head.
    d = 768
    expected = 12 * (12 * d * d + 2 * d) + 2 * 32000 * d + d
    assert f"P = {expected:,}" in out
    assert "note: --ffn not given: a d -> 4d -> d MLP assumed (3,072 = 4 x 768)" in out
    weights = next(line for line in out.splitlines() if line.startswith("weights"))
    assert "(MLP assumed d -> 4d -> d: no --ffn)" in weights
    assert "(MLP assumed" not in run("--hidden", "768", "--layers", "12", "--vocab", "32000", "--ffn", "3072")


def test_capacity_below_static_memory_formats_bytes() -> None:
    out = run("--params", "7e9", "--hidden", "4096", "--layers", "32", "--seq", "2048", "--capacity", "48GB")
    assert "fits 48GB (44.70 GiB): no (needs 112.81 GiB)" in out
    assert "static memory 104.31 GiB exceeds the capacity 48GB (44.70 GiB)" in out
