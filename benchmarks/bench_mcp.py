"""What running each MCP tool call in a limited child process costs (issue 21), side by side.

Each tool call of ``memlens mcp`` runs in a child process (``memlens.ops.runner``: a wall-clock
deadline and an address-space cap, the dashboard's limits) over descriptors the server opened,
and an analysis the server keeps travels to the child and back. This measures, on the bundled
leak sample and on a synthetic snapshot of ``--events`` events, the same sequence an assistant
sends (triage, triage again, findings, group_by) two ways: the server over stdio as a client
drives it, and the same ``Tools`` methods called in-process (what the server did before).
Each file gets a fresh cache folder, so the first call reads and analyses the pickle.

    python benchmarks/bench_mcp.py [--events 1000000]
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SEQUENCE = ("triage", "triage", "findings", "group_by")


def over_stdio(path: Path) -> list[float]:
    server = subprocess.Popen([sys.executable, "-m", "memlens", "mcp"], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, cwd=REPO)
    assert server.stdin is not None and server.stdout is not None
    ids = iter(range(1, 1000))

    def request(method: str, params: dict[str, object]) -> dict[str, object]:
        assert server.stdin is not None and server.stdout is not None
        server.stdin.write(json.dumps({"jsonrpc": "2.0", "id": next(ids), "method": method, "params": params}) + "\n")
        server.stdin.flush()
        answer: dict[str, object] = json.loads(server.stdout.readline())
        return answer

    request("initialize", {"protocolVersion": "2025-06-18", "capabilities": {},
                           "clientInfo": {"name": "bench", "version": "0"}})
    server.stdin.write(json.dumps({"jsonrpc": "2.0", "method": "notifications/initialized"}) + "\n")
    server.stdin.flush()
    times = []
    for tool in SEQUENCE:
        start = time.perf_counter()
        answer = request("tools/call", {"name": tool, "arguments": {"snapshot": str(path)}})
        times.append(time.perf_counter() - start)
        assert not answer["result"].get("isError"), answer  # type: ignore[attr-defined]
    server.stdin.close()
    server.wait(timeout=300)
    return times


def in_process(path: Path) -> list[float]:
    from memlens.mcp_server import Tools

    tools = Tools()
    times = []
    for tool in SEQUENCE:
        start = time.perf_counter()
        getattr(tools, tool)(str(path))
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--events", type=int, default=1_000_000)
    args = parser.parse_args()
    from memlens.synthetic import synthetic_snapshot

    with tempfile.TemporaryDirectory() as folder:
        big = Path(folder) / f"synthetic_{args.events}.pickle"
        big.write_bytes(pickle.dumps(synthetic_snapshot(args.events, seed=3), protocol=4))
        for path in (REPO / "sample_snapshots" / "leak.pickle", big):
            results = {}
            for name, run in (("in-process", in_process), ("sandboxed", over_stdio)):
                os.environ["MEMLENS_CACHE_DIR"] = tempfile.mkdtemp(dir=folder)
                results[name] = run(path)
            print(f"{path.name} ({path.stat().st_size / 2**20:.1f} MiB)")
            print(f"  {'call':<10} {'in-process':>11} {'sandboxed':>10} {'ratio':>7}")
            for tool, before, after in zip(SEQUENCE, results["in-process"], results["sandboxed"], strict=True):
                print(f"  {tool:<10} {before:>10.2f}s {after:>9.2f}s {after / max(before, 1e-3):>6.1f}x")


if __name__ == "__main__":
    main()
