#!/usr/bin/env bash
# GPU check of the CUDA copy path: tests/test_cuda_copy.py and tests/test_copy_plan.py (the kernel
# against the torch path and against the host emulation of the same plans, the stream marker), then
# benchmarks/bench_gpu_copy.py and benchmarks/bench_gpu_plan.py (host planning time).
# Run from anywhere on a GPU machine with this repo; no network needed. Needs a python with
# torch (CUDA build), cupy (with NVRTC) and pytest: $PYTHON, else .venv/bin/python, else python3.
# Logs go to $OUT/ when OUT is set (else benchmarks/out/). A few minutes at most.
set -u
cd "$(dirname "$0")/.."
OUT_DIR="${OUT:-benchmarks/out}"
mkdir -p "$OUT_DIR"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

probe='
import sys
missing = []
try:
    import torch
    if not torch.cuda.is_available():
        missing.append(f"a CUDA device for torch {torch.__version__} (cuda {torch.version.cuda})")
except Exception as e:
    missing.append(f"torch ({e})")
try:
    import cupy
    cupy.cuda.nvrtc.getVersion()
except Exception as e:
    missing.append(f"cupy with NVRTC ({type(e).__name__}: {e})")
try:
    import pytest
except Exception as e:
    missing.append("pytest")
print("; ".join(missing) or "ok")
sys.exit(1 if missing else 0)
'
PY=""
: > "$OUT_DIR/gpu_check.txt"
for cand in ${PYTHON:-} .venv/bin/python python3; do
    command -v "$cand" >/dev/null 2>&1 || continue
    if verdict=$("$cand" -c "$probe" 2>&1); then PY=$cand; break; fi
    echo "gpu_check: $cand lacks: $verdict" | tee -a "$OUT_DIR/gpu_check.txt"
done
if [ -z "$PY" ]; then
    echo "gpu_check: no python with torch (CUDA) + cupy (NVRTC) + pytest; set PYTHON=/path/to/python" \
        | tee -a "$OUT_DIR/gpu_check.txt"
    exit 2
fi

{
    echo "gpu_check: using $PY"
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1
    "$PY" -c 'import torch, cupy; print("torch", torch.__version__, "cuda", torch.version.cuda,
"| cupy", cupy.__version__, "nvrtc", cupy.cuda.nvrtc.getVersion())'
} 2>&1 | tee -a "$OUT_DIR/gpu_check.txt"

timeout 300 "$PY" -m pytest -q -rs tests/test_cuda_copy.py tests/test_copy_plan.py 2>&1 \
    | tee "$OUT_DIR/pytest.txt"
tests_rc=${PIPESTATUS[0]}
timeout 240 "$PY" benchmarks/bench_gpu_copy.py 2>&1 | tee "$OUT_DIR/bench.txt"
bench_rc=${PIPESTATUS[0]}
grep '^GPU_COPY ' "$OUT_DIR/bench.txt" | sed 's/^GPU_COPY //' > "$OUT_DIR/gpu_copy.json"
timeout 120 "$PY" benchmarks/bench_gpu_plan.py --quick 2>&1 | tee "$OUT_DIR/bench_plan.txt"
plan_rc=${PIPESTATUS[0]}
grep '^GPU_PLAN ' "$OUT_DIR/bench_plan.txt" | sed 's/^GPU_PLAN //' > "$OUT_DIR/gpu_plan.json"

echo "gpu_check: pytest rc=$tests_rc, bench rc=$bench_rc, plan bench rc=$plan_rc" \
    | tee -a "$OUT_DIR/gpu_check.txt"
[ "$tests_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ] && [ "$plan_rc" -eq 0 ]
