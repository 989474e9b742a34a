#!/usr/bin/env bash
# Build the snapshot scanner's libFuzzer harness (src/native/fuzz_scan.cpp) with clang under ASan
# and UBSan, seed a corpus with the samples, the real snapshots and the hostile corpus of the
# tests (in a temporary folder, never in the repository), and fuzz.
#
#   scripts/fuzz_scanner.sh [SECONDS] [JOBS]      (default 60 s, 1 job)
#
# Needs clang and its fuzzer runtime (Debian: apt-get install -y clang libclang-rt-dev, or the
# versioned libclang-rt-NN-dev). PYTHON: the interpreter that writes the hostile seeds (default
# python3; memlens's test helpers need numpy). MEMLENS_REAL_SNAPSHOTS: where the real snapshots
# are. FUZZ_MAX_LEN: the longest input tried (default 64 KiB: longer seeds are read cut to it, and
# short inputs run thousands of times a second where megabyte ones run ten). FUZZ_WORK: keep the build, corpus and any crash in this folder (default: a temporary one,
# kept only when a crash is found). Exit status: 0 when nothing was found, 1 on a crash.
set -euo pipefail
seconds="${1:-60}"
jobs="${2:-1}"
max_len="${FUZZ_MAX_LEN:-65536}"
repo="$(cd "$(dirname "$0")/.." && pwd)"
python="${PYTHON:-python3}"
clang="${CLANGXX:-clang++}"
command -v "$clang" >/dev/null || { echo "fuzz_scanner: $clang not found (apt-get install -y clang libclang-rt-dev)" >&2; exit 2; }
work="${FUZZ_WORK:-$(mktemp -d -t memlens-fuzz.XXXXXX)}"
mkdir -p "$work/corpus" "$work/artifacts" "$work/generated"
# The scanner's limits are declared in memlens/snapshot/limits.py; CMake writes their header for the
# extension, and this writes the same one for the harness.
(cd "$repo" && "$python" src/native/generate_constants.py "$work/generated/scan_limits.hpp" kScanLimits \
  memlens/snapshot/limits.py)
"$clang" -std=c++17 -g -O1 -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined \
  -I"$repo/src/native" -I"$work/generated" "$repo/src/native/pickle_scan.cpp" "$repo/src/native/fuzz_scan.cpp" \
  -o "$work/fuzz_scan"
real="${MEMLENS_REAL_SNAPSHOTS:-$repo/../shared/real_snapshots}"
cp "$repo"/sample_snapshots/*.pickle "$work/corpus/" 2>/dev/null || true
if [ -d "$real" ]; then
  find "$real" -maxdepth 1 -name '*.pickle' -exec cp {} "$work/corpus/" \;
fi
# The hostile corpus (tests/hostile_files.py), each file as the tests build it; gzip ones inflated
# (the scanner reads pickles), all cut to 4 MiB (past that a seed only slows the fuzzer down).
(cd "$repo" && "$python" - "$work/corpus" <<'PY'
import gzip, sys
from pathlib import Path
import pickle
from tests.hostile_files import CORPUS, entry, snapshot
out = Path(sys.argv[1])
# Small well-formed snapshots in every protocol: short seeds the fuzzer mutates fast.
small = snapshot(device_traces=[[entry("alloc", 0, 512, user_metadata="m", compile_context="N/A"),
                                 entry("oom", 0, 1 << 30, device_free=1 << 20, stream=(1 << 64) - 1)]])
for protocol in range(6):
    (out / f"small_protocol_{protocol}").write_bytes(pickle.dumps(small, protocol=protocol))
for attack, builds in CORPUS.items():
    for name, build in builds.items():
        data = build()
        if data[:2] == b"\x1f\x8b":
            data = gzip.GzipFile(fileobj=__import__("io").BytesIO(data)).read(4 << 20)
        safe = "".join(c if c.isalnum() else "_" for c in f"hostile_{attack}_{name}")
        (out / safe).write_bytes(data[: 4 << 20])
PY
) || echo "fuzz_scanner: the hostile seeds were not written (PYTHON=$python cannot import tests.hostile_files)" >&2
echo "fuzz_scanner: $(ls "$work/corpus" | wc -l) seeds in $work/corpus; fuzzing ${seconds}s x $jobs job(s)"
status=0
(cd "$work" && ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 \
  ./fuzz_scan -max_total_time="$seconds" -timeout=20 -rss_limit_mb=2048 -max_len="$max_len" \
  -jobs="$jobs" -workers="$jobs" -artifact_prefix="$work/artifacts/" -print_final_stats=1 corpus) || status=1
# libFuzzer keeps an input that took over 10 s of wall time as slow-unit-*, and a job starved by
# other work on a busy machine makes any input that slow (a hang is a timeout-*, at -timeout=20).
# Each is run again alone: it stays a finding only if it is slow (over 2 s) or fails there too.
for unit in "$work/artifacts/"slow-unit-*; do
  [ -e "$unit" ] || continue
  started=$(date +%s%N)
  if (cd "$work" && ./fuzz_scan "$unit" >/dev/null 2>&1); then
    took_ms=$(( ($(date +%s%N) - started) / 1000000 ))
    if [ "$took_ms" -lt 2000 ]; then
      echo "fuzz_scanner: $(basename "$unit") ran in ${took_ms} ms alone: slow only while the machine was busy" >&2
      rm -f "$unit"
    fi
  fi
done
if ls "$work/artifacts/"* >/dev/null 2>&1; then
  echo "fuzz_scanner: FOUND: $(ls "$work/artifacts")  (in $work/artifacts)" >&2
  status=1
elif [ -z "${FUZZ_WORK:-}" ] && [ "$status" = 0 ]; then
  rm -rf "$work"
fi
exit "$status"
