"""Hostile snapshot files: how long ``memlens triage`` takes on each and its peak RSS.

Writes every file of ``tests/hostile_files.CORPUS`` (hash bombs, shared references, deep
nesting, bad numbers, huge strings, many devices) and runs ``memlens triage FILE --no-cache``
on each in a fresh process under an address-space limit, reading the child's own peak RSS
from ``os.wait4``. Target (issue 11): each ends in one line on stderr and exit 2, or in an
analysis (exit 0), within seconds and with memory bounded by its content.

Then the second round (issue 21), attacks on what runs after reading: the exports of rows
sharing one deep stack (bytes written against the file's size), rules files (a catastrophic
pattern, 5,000 rules, a FIFO, a count RE2 refuses) through ``triage --rules``, and ``diff`` of
the deep-stack files, each with its time and peak RSS.

    python benchmarks/hostile_corpus.py [--keep DIR] [--limit-gib 2] [--timeout 60]
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.hostile_files import ACCEPTED, CORPUS  # noqa: E402 - after the path is set


def run(path: Path, limit: int, timeout: float, *extra: str, env: dict[str, str] | None = None,
        command: tuple[str, ...] | None = None) -> tuple[int | None, float, int, str]:
    """(exit code or None on timeout, seconds, peak RSS bytes, stderr's last line); ``command``:
    memlens' arguments instead of ``triage PATH EXTRA``."""

    def cap_memory() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    started = time.perf_counter()
    with tempfile.TemporaryFile() as err:
        child = subprocess.Popen(
            [sys.executable, "-m", "memlens",
             *(command or ("triage", str(path), *(extra or ("--no-cache",))))],
            stdout=subprocess.DEVNULL, stderr=err, cwd=REPO, preexec_fn=cap_memory, env=env,
        )
        code: int | None = None
        while time.perf_counter() - started < timeout:
            pid, status, usage = os.wait4(child.pid, os.WNOHANG)
            if pid:
                code = os.waitstatus_to_exitcode(status)
                break
            time.sleep(0.02)
        else:
            child.kill()
            _, _, usage = os.wait4(child.pid, 0)
        elapsed = time.perf_counter() - started
        err.seek(0)
        lines = err.read().decode(errors="replace").strip().splitlines()
    return code, elapsed, usage.ru_maxrss * 1024, lines[-1] if lines else ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--keep", help="write the files into this folder and keep them")
    parser.add_argument("--limit-gib", type=float, default=2.0, help="address-space limit per run")
    parser.add_argument("--timeout", type=float, default=60.0)
    args = parser.parse_args()
    folder = Path(args.keep or tempfile.mkdtemp(prefix="memlens-hostile-"))
    folder.mkdir(parents=True, exist_ok=True)
    limit = int(args.limit_gib * (1 << 30))

    print(f"{'attack':25} {'file':18} {'size':>11} {'exit':>4} {'seconds':>7} {'peak RSS':>9}  outcome")
    worst_time, worst_rss, bad = 0.0, 0, []
    for attack, files in CORPUS.items():
        for name, build in files.items():
            path = folder / f"{attack}-{name}.pickle".replace(" ", "_").replace("*", "")
            path.write_bytes(build())
            code, seconds, rss, last = run(path, limit, args.timeout)
            accepted = (attack, name) in ACCEPTED
            ok = code == (0 if accepted else 2)
            worst_time, worst_rss = max(worst_time, seconds), max(worst_rss, rss)
            outcome = "analysed" if code == 0 else ("timeout" if code is None else last.split(": ", 3)[-1])
            if accepted:  # what the snapshot cache of an accepted file costs on disk
                with tempfile.TemporaryDirectory() as home:
                    run(path, limit, args.timeout, "--cache", env=dict(os.environ, XDG_CACHE_HOME=home))
                    cached = sum(f.stat().st_size for f in Path(home).rglob("*") if f.is_file())
                outcome += f", cache {cached / path.stat().st_size:.1f}x the file"
            if not ok:
                bad.append(f"{attack}/{name}")
            print(f"{attack:25} {name:18} {path.stat().st_size:>11,} {code if code is not None else '-':>4} "
                  f"{seconds:7.2f} {rss / 2**20:7.0f}Mi  {'' if ok else 'UNEXPECTED '}{outcome[:90]}")
    print(f"\nlargest time {worst_time:.2f} s, largest peak RSS {worst_rss / 2**20:.0f} MiB "
          f"(fresh process each, memlens imports included; limit {args.limit_gib:g} GiB)")
    round_time, round_rss = second_round(folder, limit, args.timeout, bad)
    print(f"\nsecond round: largest time {round_time:.2f} s, largest peak RSS {round_rss / 2**20:.0f} MiB")
    if bad:
        print("unexpected outcomes: " + ", ".join(bad))
        sys.exit(1)


def second_round(folder: Path, limit: int, timeout: float, bad: list[str]) -> tuple[float, int]:
    """Exports, rules and diff on hostile inputs; (largest seconds, largest peak RSS)."""
    import json

    from tests.hostile_files import allocations_sharing_a_deep_stack, releases_sharing_a_deep_stack

    deep = folder / "second-allocations-deep-stack.pickle"
    deep.write_bytes(allocations_sharing_a_deep_stack())
    releases = folder / "second-releases-deep-stack.pickle"
    releases.write_bytes(releases_sharing_a_deep_stack())
    rules = {
        "catastrophic": json.dumps({"rules": {"evil": "(a+)+$"}}),
        "5,000 rules": json.dumps([{"name": f"r{i}", "pattern": rf"call_{i}\b|f{i}\.py"} for i in range(5000)]),
        "a{4294967295}": json.dumps({"rules": {"x": "a{4294967295}"}}),
    }
    fifo = folder / "second-rules-fifo.json"
    if not fifo.exists():
        os.mkfifo(fifo)
    cases: list[tuple[str, tuple[str, ...], int, Path | None]] = []
    for fmt in ("csv", "jsonl"):
        out = folder / f"second-export.{fmt}"
        cases.append((f"export {fmt}", ("export", str(deep), "-o", str(out), "--no-analysis"), 0, out))
    for name, text in rules.items():
        path = folder / f"second-rules-{name.replace(',', '').replace(' ', '_')}.json"
        path.write_text(text)
        cases.append((f"rules {name}", ("triage", str(deep), "--rules", str(path), "--no-cache"),
                      2 if "4294967295" in name else 0, None))
    cases.append(("rules FIFO", ("triage", str(deep), "--rules", str(fifo), "--no-cache"), 2, None))
    cases.append(("diff", ("diff", str(releases), str(deep)), 0, None))
    print(f"\n{'second round':25} {'input':>11} {'exit':>4} {'seconds':>7} {'peak RSS':>9}  outcome")
    worst_time, worst_rss = 0.0, 0
    for name, command, expected, out in cases:
        code, seconds, rss, last = run(deep, limit, timeout, command=command)
        worst_time, worst_rss = max(worst_time, seconds), max(worst_rss, rss)
        outcome = "ok" if code == 0 else ("timeout" if code is None else last.split(": ", 3)[-1])
        if out is not None and out.exists():
            outcome += f", wrote {out.stat().st_size / deep.stat().st_size:.0f}x the file"
            out.unlink()
        if code != expected:
            bad.append(f"second round/{name}")
        print(f"{name:25} {deep.stat().st_size:>11,} {code if code is not None else '-':>4} {seconds:7.2f} "
              f"{rss / 2**20:7.0f}Mi  {'' if code == expected else 'UNEXPECTED '}{outcome[:90]}")
    return worst_time, worst_rss


if __name__ == "__main__":
    main()
