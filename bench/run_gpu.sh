#!/usr/bin/env bash
# GPU checks in one bounded run: the conformance suite on CUDA, then the GPU benchmarks.
# Usage: [PYTHON=/path/to/python] bench/run_gpu.sh OUTDIR   (from anywhere; no install needed:
# PYTHONPATH is set to the repository)
# Total wall time is bounded well inside 9 minutes: 240 s + 240 s + 45 s at most.
set -u
OUT=${1:?usage: bench/run_gpu.sh OUTDIR}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/.."
export PYTHONPATH=.
PY=${PYTHON:-python}
status=0

{ nvidia-smi || true; $PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0))"; } \
  > "$OUT/env.txt" 2>&1

echo "== conformance (cuda)"
timeout 240 $PY -m pytest conformance --device cuda -x -q -p no:cacheprovider \
  --junitxml="$OUT/conformance-cuda.xml" > "$OUT/conformance-cuda.txt" 2>&1
rc=$?; echo "conformance exit $rc"; tail -3 "$OUT/conformance-cuda.txt"; [ $rc -eq 0 ] || status=1

echo "== precision_gpu"
timeout 240 $PY bench/precision_gpu.py --out "$OUT" > "$OUT/precision_gpu.txt" 2>&1
rc=$?; echo "precision_gpu exit $rc"; tail -25 "$OUT/precision_gpu.txt"; [ $rc -eq 0 ] || status=1

echo "== syncs (cuda)"
timeout 45 $PY bench/syncs.py --device cuda --out "$OUT" > "$OUT/syncs_cuda.txt" 2>&1
rc=$?; echo "syncs exit $rc"; tail -6 "$OUT/syncs_cuda.txt"; [ $rc -eq 0 ] || status=1

exit $status
