"""Serialising and validating a large report: msgspec (what memlens uses) against pydantic v2 and
the standard library, side by side on the same ``Report``.

The report is analysed from a synthetic snapshot and then given ``--steps`` steps (a long run
recorded whole), so the JSON is the size a real week-long job's report reaches. Each row prints
the best of ``--repeat`` and its ratio to msgspec. pydantic is optional: without it, its rows say
so.

    python benchmarks/bench_schema.py [--steps 5000] [--repeat 5]
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import msgspec
from bench_analysis import best_of

from memlens.analysis import analyze
from memlens.analysis.report import Report, Step
from memlens.snapshot.reader import parse
from memlens.synthetic import synthetic_snapshot


def big_report(steps: int) -> Report:
    report = analyze(parse(synthetic_snapshot(100_000), source="<synthetic>"))
    device = report.device()
    device.steps = [Step(i, i * 10, i * 10 + 10, i * 1000, i * 1000 + 900) for i in range(steps)]
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5000)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    report = big_report(args.steps)
    text = report.to_json_str(indent=None).encode()
    print(f"report: {args.steps:,} steps, {len(report.findings)} findings, {len(text) / 1024:.0f} KiB of JSON")

    rows: list[tuple[str, float | None]] = []
    encode_s, _ = best_of(lambda: msgspec.json.encode(report), args.repeat)
    decode_s, _ = best_of(lambda: msgspec.json.decode(text, type=Report), args.repeat)
    rows += [("msgspec: encode", encode_s), ("msgspec: decode + validate", decode_s)]
    asdict_s, _ = best_of(lambda: json.dumps(dataclasses.asdict(report)).encode(), args.repeat)
    loads_s, _ = best_of(lambda: json.loads(text), args.repeat)
    rows += [("stdlib: asdict + json.dumps", asdict_s), ("stdlib: json.loads (no validation)", loads_s)]
    try:
        from pydantic import TypeAdapter
    except ImportError:
        rows += [("pydantic v2: not installed", None)]
    else:
        adapter = TypeAdapter(Report)
        dump_s, _ = best_of(lambda: adapter.dump_json(report), args.repeat)
        validate_s, _ = best_of(lambda: adapter.validate_json(text), args.repeat)
        rows += [("pydantic v2: dump_json", dump_s), ("pydantic v2: validate_json", validate_s)]
    for label, seconds in rows:
        if seconds is None:
            print(f"  {label}")
            continue
        base = encode_s if "encode" in label or "dump" in label or "asdict" in label else decode_s
        print(f"  {label:<38} {seconds * 1000:8.2f} ms   {seconds / base:5.1f}x msgspec")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
