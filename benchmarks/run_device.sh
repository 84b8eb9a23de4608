#!/usr/bin/env bash
# One device call for the kernels: every GPU test (kernels, model, decode graphs and
# async scheduling), MLA decode (CUDA C++, Triton, FlashInfer), GEMM and MoE benchmarks, decode
# step times with and without CUDA graphs; summary tables printed last.
# On an H200 with the device wheels installed (`.device-wheels`):
#   source .device-wheels/install.sh && bash benchmarks/run_device.sh [sweep|final|ours]
# sweep: also time candidate configs; ours: only our decode kernels (no FlashInfer, torch
# reference or GEMM benchmark), for a quick re-measure after changing defaults.
# Logs land in $OUT (at most 8 files come back from the device).
set -uo pipefail
cd "$(dirname "$0")/.."  # the repository root: python3 -m benchmarks.* runs from here
OUT=${OUT:-/tmp/mlaserve-device}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
mode=${1:-final}
{
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,power.draw --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  python3 -c "import flashinfer; print('flashinfer', flashinfer.__version__)"
  date -u
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

export MLASERVE_KERNEL_CACHE=${MLASERVE_KERNEL_CACHE:-/tmp/mlaserve-kernels}
timeout 420 python3 -m pytest -m gpu tests/kernels tests/model tests/server/test_cuda_graphs.py \
  -q --maxfail=20 -p no:cacheprovider -W ignore::DeprecationWarning > "$OUT/pytest.log" 2>&1
echo "pytest rc=$?"; grep -E "passed|failed|Error|assert" "$OUT/pytest.log" | tail -15

extra=()
[ "$mode" = sweep ] && extra=(--sweep --sweep-batch 128)
[ "$mode" = ours ] && extra=(--variants cuda-fp8,ours-fp8,ours-bf16)
python3 -m benchmarks.bench_mla_decode "${extra[@]}" --json "$OUT/mla.json" --markdown "$OUT/mla.md" \
  > "$OUT/bench_mla.log" 2>&1
echo "bench_mla rc=$?"; grep -E "sweep|FAILED|Error|error" "$OUT/bench_mla.log" | tail -40
if [ "$mode" != ours ]; then
  python3 -m benchmarks.bench_gemm --json "$OUT/gemm.json" --markdown "$OUT/gemm.md" > "$OUT/bench_gemm.log" 2>&1
  echo "bench_gemm rc=$?"; tail -3 "$OUT/bench_gemm.log" | grep -i error
  timeout 240 python3 -m benchmarks.bench_moe --quick --output-json "$OUT/moe.json" > "$OUT/bench_moe.log" 2>&1
  echo "bench_moe rc=$?"
  timeout 120 python3 -m benchmarks.bench_decode_graphs --model deepseek-v2-lite --batch 1 8 64 --context 512 \
    --steps 20 --output-json "$OUT/decode_graphs.json" > "$OUT/decode_graphs.log" 2>&1
  echo "decode graphs rc=$?"; tail -6 "$OUT/decode_graphs.log"
  sed -n '/^| shape/,$p' "$OUT/bench_moe.log"
fi
cat "$OUT/gemm.md" "$OUT/mla.md" 2>/dev/null
