#!/usr/bin/env bash
# Issue 23's R1 workload in one device call: the DeepSeek-R1 shape cut to its first 4 layers (3
# dense + 1 MoE layer of 256 FP8 experts; random weights made on the device), random 1024 in /
# 1024 out, 512 prompts, under vLLM's R1 launch flags (--max-num-seqs 512
# --max-num-batched-tokens 16384 --async-scheduling), FP8 latent cache.
#   source .device-wheels/install.sh && bash benchmarks/run_r1_slice.sh [extra bench flags]
# Logs and JSON land in $OUT; the throughput line is printed last (output tok/s is the figure
# the issue compares: 17,200 at main a1d072d on the H200).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/mlaserve-r1}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 MLASERVE_KERNEL_CACHE=${MLASERVE_KERNEL_CACHE:-/tmp/mlaserve-kernels}
timeout "${R1_TIMEOUT:-300}" python3 -m server bench throughput --model deepseek-r1 --num-layers 4 --device cuda \
  --kv-cache-dtype fp8 --input-len 1024 --output-len 1024 --num-prompts 512 --max-num-seqs 512 \
  --max-num-batched-tokens 16384 --async-scheduling --disable-tqdm "$@" \
  --output-json "$OUT/r1_slice.json" > "$OUT/r1_slice.log" 2>&1
echo "r1 slice rc=$?"
grep -E "Throughput|Error" "$OUT/r1_slice.log" || tail -3 "$OUT/r1_slice.log"
