#!/usr/bin/env bash
# One device call for the CUDA C++ MLA decode: build, GPU tests, then timings of it against
# our Triton kernel (and FlashInfer fa3 when `full` is given), with a launch-shape sweep.
#   source .device-wheels/install.sh && bash benchmarks/run_cuda_decode.sh [quick|full]
# Logs land in $OUT; the summary table is printed last.
set -uo pipefail
cd "$(dirname "$0")/.."  # the repository root: python3 -m benchmarks.* runs from here
OUT=${OUT:-/tmp/mlaserve-cuda}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 MLASERVE_KERNEL_CACHE=${MLASERVE_KERNEL_CACHE:-/tmp/mlaserve-kernels}
mode=${1:-quick}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader
git rev-parse --short HEAD 2>/dev/null
t0=$(date +%s)
python3 -c "from server import envs; from kernels.mla_decode_cuda import build_library; print(build_library(out_dir=envs.MLASERVE_KERNEL_CACHE))" 2>&1 | tail -3
echo "build $(( $(date +%s) - t0 )) s"
timeout 300 python3 -m pytest -m gpu tests/kernels/test_mla_decode_cuda.py -q -x -p no:cacheprovider \
  > "$OUT/pytest_cuda.log" 2>&1
echo "pytest rc=$?"; grep -E "passed|failed|Error|assert|error" "$OUT/pytest_cuda.log" | head -20
variants=cuda-fp8,ours-fp8
[ "$mode" = full ] && variants=cuda-fp8,ours-fp8,ours-bf16,fi-fa3-bf16,fi-fa3-fp8
[ "$mode" = dev ] && variants=cuda-fp8
timeout 400 python3 -m benchmarks.bench_mla_decode --variants $variants --sweep --sweep-what cuda \
  --sweep-batch 64 128 --batch 64 128 --heads 16 128 --sq 1 2 --json "$OUT/mla.json" --markdown "$OUT/mla.md" \
  > "$OUT/bench.log" 2>&1
echo "bench rc=$?"
grep -E "sweep-cuda|FAILED" "$OUT/bench.log" | cut -c1-200 | head -60
if [ "$mode" = ncu ] || [ "${NCU:-0}" = 1 ]; then
  timeout 120 ncu --clock-control none -k regex:mla_decode_fp8 -c 1 --section SpeedOfLight --section WarpStateStats \
    --section SchedulerStats --section Occupancy --section ComputeWorkloadAnalysis --section InstructionStats python3 -m benchmarks.profile_mla_cuda > "$OUT/ncu.txt" 2>&1
  echo "ncu rc=$?"; grep -E "Throughput|Duration|Issued|Eligible|Active Warps|Achieved Occ|Pipe|IPC|Utilization" "$OUT/ncu.txt" | head -40
fi
cat "$OUT/mla.md"
