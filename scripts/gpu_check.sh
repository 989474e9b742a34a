#!/usr/bin/env bash
# The checks that need a real GPU, in one short run (for a session that is lent one):
#   bash scripts/gpu_check.sh [OUT_DIR]            (default: $OUT, else /tmp/memlens-gpu)
# Works from a bare checkout: memlens need not be pip-installed (PYTHONPATH is the checkout and
# the CLI runs as `python3 -m memlens.cli.main`), and record/triage/whatif need only torch,
# numpy, click and rich. Every step runs even when an earlier one fails; each step's output is
# OUT_DIR/<step>.txt and its exit code a line of OUT_DIR/summary.txt. The script exits 1 when
# any step failed.
#  1. environment: python, torch, CUDA device; which optional packages are importable
#  2. pytest -m gpu (tests/gpu: recording with step markers, stacks="none", OOM observer, cap restored)
#  3. memlens record of examples/train_tiny.py on CUDA, through the CLI, six optimizer steps
#  4. memlens triage and memlens whatif of that snapshot; what the recorder knew (tensor roles:
#     under 5% "unknown" at the peak; module scopes; memory outside PyTorch from mem_get_info)
#  5. SIGTERM mid-recording on CUDA (snapshot written, exit 143); two recordings at once into one folder
#  6. leak recall on CUDA: the loops of tests/integration/leaky_loop.py (scripts/gpu_leak_recall.py)
#  7. that record/triage/whatif never imported plotly, dash or orjson
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
repo="$PWD"
out="${1:-${OUT:-/tmp/memlens-gpu}}"
mkdir -p "$out" || exit 2
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
python="${PYTHON:-python3}"
memlens=("$python" -m memlens.cli.main)
summary="$out/summary.txt"
: >"$summary"
failed=0

# step NAME COMMAND...: run it, keep its output in OUT/NAME.txt, note its exit code.
step() {
    local name="$1"
    shift
    echo "== $name: $*" | tee "$out/$name.txt"
    local start=$SECONDS
    "$@" >>"$out/$name.txt" 2>&1
    local code=$?
    tail -n 40 "$out/$name.txt"
    echo "$name exit=$code seconds=$((SECONDS - start))" | tee -a "$summary"
    [ "$code" -eq 0 ] || failed=1
}

step env "$python" -c "
import importlib.util, platform, torch
print('python', platform.python_version(), 'torch', torch.__version__, 'cuda', torch.version.cuda)
print('device', torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'NONE')
for name in ('numpy', 'click', 'rich', 'plotly', 'dash', 'orjson', 'hypothesis', 'psutil'):
    print(name, 'yes' if importlib.util.find_spec(name) else 'no')
assert torch.cuda.is_available(), 'no CUDA device'
"

# -W default: show warnings instead of failing on them (pyproject turns them into errors for CI).
step pytest_gpu "$python" -m pytest -m gpu -v -p no:cacheprovider -W default tests/gpu

# Six optimizer steps recorded through the CLI, exactly as a user runs it.
step record "${memlens[@]}" record --device cuda --out "$out/run" -- "$python" examples/train_tiny.py \
    --device cuda --steps 6 --d-model 512 --layers 6 --batch 32 --seq 256
snapshot="$(ls "$out"/run/*.pickle 2>/dev/null | head -n 1)"
step triage "${memlens[@]}" triage "${snapshot:-$out/run/snapshot.pickle}" --width 110 --no-color --no-cache
step whatif "${memlens[@]}" whatif "${snapshot:-$out/run/snapshot.pickle}" --expandable-segments
step sidecar "$python" -c "
import json, sys
sidecar = json.load(open(sys.argv[1].removesuffix('.pickle') + '.memlens.json'))
print(json.dumps({k: sidecar[k] for k in ('backend', 'reason', 'device', 'steps', 'peak_allocated_bytes', 'torch_version')}, indent=1))
assert sidecar['backend'] == 'cuda' and len(sidecar['steps']) == 6, 'expected six CUDA steps'
" "${snapshot:-$out/run/snapshot.pickle}"

# What the recorder knew on CUDA: exact categories from the tensor roles, module scopes among the
# annotations, and the CUDA context / NCCL bytes outside the caching allocator at step boundaries.
step recorder_knowledge "$python" -c "
import json, sys
import memlens
path = sys.argv[1]
sidecar = json.load(open(path.removesuffix('.pickle') + '.memlens.json'))
readings = sidecar.get('outside_pytorch') or []
print('model', sidecar.get('model'), 'optimizer', sidecar.get('optimizer'))
print('outside_pytorch readings', len(readings), 'max', max((r['outside_pytorch_bytes'] for r in readings), default=None))
print('tensor_roles records', len((sidecar.get('tensor_roles') or {}).get('records', [])))
snapshot = memlens.load(path, cache=False)
scopes = {a.name.split('#')[0] for a in snapshot.annotations}
print('annotation kinds', sorted(scopes))
device = memlens.analyze(snapshot).device()
cats = device.categories_at_peak
print('categories at the peak', {k: v for k, v in cats.items() if v}, 'outside PyTorch', device.outside_pytorch_bytes)
assert sidecar['optimizer'] is not None and sidecar['model'] is not None, 'model and optimizer from the hooked optimizer'
assert readings and device.outside_pytorch_bytes is not None, 'mem_get_info readings at step boundaries'
assert 'memlens.forward' in scopes, 'module scopes recorded'
assert cats['unknown'] < 0.05 * device.peak_allocated_bytes, 'under 5% unknown at the peak'
" "${snapshot:-$out/run/snapshot.pickle}"

# SIGTERM (what torchrun and schedulers send) in the middle of a CUDA recording: the snapshot is
# written, then the run exits 143; two recordings at once into one folder keep both snapshots.
cat >"$out/until_signalled.py" <<'PY'
import sys, time
import torch
model = torch.nn.Linear(1024, 1024).cuda()
optimizer = torch.optim.AdamW(model.parameters())
for step in range(100_000):
    model(torch.randn(256, 1024, device="cuda")).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()
    if step == 3:
        print("started", flush=True)
    if step >= 3 and len(sys.argv) > 1 and step >= int(sys.argv[1]):
        break
    time.sleep(0.005)
PY
sigterm_check() {
    "${memlens[@]}" record --device cuda --out "$out/sigterm" -- "$python" "$out/until_signalled.py" \
        >"$out/sigterm.stdout" 2>&1 &
    local pid=$! waited=0
    until grep -qs started "$out/sigterm.stdout" || [ "$waited" -ge 120 ]; do sleep 0.5; waited=$((waited + 1)); done
    kill -TERM "$pid"
    wait "$pid"
    local code=$?
    cat "$out/sigterm.stdout"
    echo "exit status $code (expected 143)"
    "$python" -c "
import json, sys, memlens
sidecar = json.load(open(sys.argv[1] + '/snapshot.memlens.json'))
print('reason', sidecar['reason'], 'backend', sidecar['backend'], 'steps', len(sidecar['steps']))
print('events', memlens.load(sys.argv[1] + '/snapshot.pickle').devices[0].events)
assert sidecar['reason'] == 'terminated' and sidecar['backend'] == 'cuda'
" "$out/sigterm" && [ "$code" -eq 143 ]
}
step sigterm sigterm_check
concurrent_check() {
    "${memlens[@]}" record --device cuda --out "$out/both" -- "$python" "$out/until_signalled.py" 40 &
    local first=$!
    "${memlens[@]}" record --device cuda --out "$out/both" -- "$python" "$out/until_signalled.py" 40
    local second=$?
    wait "$first"
    local first_code=$?
    ls -a "$out/both"
    [ "$first_code" -eq 0 ] && [ "$second" -eq 0 ] && [ -f "$out/both/snapshot.pickle" ] && [ -f "$out/both/snapshot-2.pickle" ]
}
step concurrent concurrent_check

# Leak recall on a real caching allocator: each loop of tests/integration/leaky_loop.py, API and CLI.
step leak_recall "$python" scripts/gpu_leak_recall.py "$out/leaks"

printf 'import torch\nprint(torch.ones(4).sum().item())\n' >"$out/no_training.py"
step imports "$python" -c "
import sys
from click.testing import CliRunner
from memlens.cli.main import cli
runner = CliRunner()
sample = 'sample_snapshots/leak.pickle'
for args in (['triage', sample, '--no-cache'], ['whatif', sample, '--expandable-segments'],
             ['record', '--device', 'cpu', '--out', sys.argv[1] + '/imports_run', '--', 'python', sys.argv[1] + '/no_training.py']):
    result = runner.invoke(cli, args)
    print(args[0], 'exit', result.exit_code)
    assert result.exit_code == 0, result.output
heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('plotly', 'dash', 'orjson'))
print('heavy modules imported:', heavy or 'none')
assert not heavy, heavy
" "$out"

echo "summary ($summary):"
cat "$summary"
exit "$failed"
