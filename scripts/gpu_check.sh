#!/usr/bin/env bash
# The checks that need a real GPU, in one short run (for a session that is lent one):
#   bash scripts/gpu_check.sh [OUT_DIR]
# 1. pytest -m gpu (CUDA recording, step markers, a captured OOM);
# 2. record the tiny LM on CUDA with the CLI, then triage and what-if the result.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-${OUT:-/tmp/memlens-gpu}}"
mkdir -p "$out"
python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0))"
python -m pytest -m gpu -q tests/gpu 2>&1 | tee "$out/pytest-gpu.txt"
memlens record --device cuda --out "$out/run" -- python examples/train_tiny.py --device cuda --steps 6 \
    --d-model 512 --layers 6 --batch 32 --seq 256 | tee "$out/record.txt"
memlens triage "$out"/run/*.pickle --width 110 --no-color | tee "$out/triage.txt"
memlens whatif "$out"/run/*.pickle --expandable-segments | tee "$out/whatif.txt"
