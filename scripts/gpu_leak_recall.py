"""Leak recall on a real CUDA caching allocator (a step of scripts/gpu_check.sh).

Each loop of tests/integration/leaky_loop.py is recorded twice on CUDA, through
``memlens.record`` in this process and through ``memlens record`` in a child, and analysed: the
leaks must come out at the bytes per step the allocator holds (a kept 0-d loss is one 512-byte
block), the healthy and hand-over loops clean. Prints one line per recording; exits 1 on a miss.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

import memlens
from tests.integration import leaky_loop

STEPS = 6
TOLERANCE = 0.25  # the recall bar: bytes per step within 25%


def verdict(snapshot: Path, pattern: str) -> tuple[bool, str]:
    report = memlens.analyze(snapshot)
    leaks = [f for f in report.findings if f.kind == "leak"]
    expected = leaky_loop.expected_bytes_per_step(pattern)
    if expected == 0:
        return not leaks, f"expected no leak, found {[int(f.evidence['bytes_per_step']) for f in leaks]}"
    if not leaks:
        return False, f"expected {expected} B/step, found no leak"
    found = int(leaks[0].evidence["bytes_per_step"])
    ok = abs(found - expected) <= TOLERANCE * expected
    return ok, f"expected {expected:,} B/step, found {found:,} ({leaks[0].severity})"


def main() -> int:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="memlens-leaks-"))
    device = sys.argv[2] if len(sys.argv) > 2 else "cuda"  # "cpu" to try the script without a GPU
    misses = 0
    for pattern in leaky_loop.PATTERNS:
        api_dir = out / f"{pattern}_api"
        with memlens.record(str(api_dir), device=device) as rec:
            leaky_loop.train(pattern, STEPS, rec.step, device=device)
        cli_dir = out / f"{pattern}_cli"
        subprocess.run([sys.executable, "-m", "memlens", "record", "--device", device, "--out", str(cli_dir), "--",
                        sys.executable, leaky_loop.__file__, pattern, str(STEPS), device], check=True)
        for way, folder in (("api", api_dir), ("cli", cli_dir)):
            ok, text = verdict(next(folder.glob("*.pickle")), pattern)
            misses += not ok
            print(f"{'ok  ' if ok else 'MISS'} {pattern:<13} {way}: {text}", flush=True)
    return 1 if misses else 0


if __name__ == "__main__":
    sys.exit(main())
