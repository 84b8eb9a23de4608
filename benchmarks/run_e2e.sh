#!/usr/bin/env bash
# One device call for the engine on GPU: the seed's end-to-end workload (random 8192 in / 1024
# out) on a random-weight DeepSeek-V2-Lite-shaped model, bf16 and FP8 KV cache, each with
# synchronous and with overlapping (--async-scheduling) steps. ~100 s per run on an H200.
#   source .device-wheels/install.sh && bash benchmarks/run_e2e.sh [NUM_PROMPTS] [extra bench flags]
# KVS="fp8" (env) runs only the listed KV-cache dtypes (default "auto fp8"); MODES="async" only the
# listed step modes (default "sync async"); E2E_TIMEOUT the seconds each run may take (default 140).
# e.g. `bash benchmarks/run_e2e.sh 100 --step-profile` for the per-step breakdown (it
# synchronizes at phase boundaries, so it also turns the async overlap off).
# GPU tests and decode-graph timings are in run_device.sh. Logs land in $OUT; summary last.
set -uo pipefail
cd "$(dirname "$0")/.."  # the repository root: python3 -m benchmarks.* runs from here
OUT=${OUT:-/tmp/mlaserve-e2e}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 MLASERVE_KERNEL_CACHE=${MLASERVE_KERNEL_CACHE:-/tmp/mlaserve-kernels}
n=${1:-100}
[ $# -gt 0 ] && shift
git rev-parse --short HEAD 2>/dev/null > "$OUT/commit.txt"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/env.txt"

extra=("$@")
for mode in ${MODES:-sync async}; do
  for kv in ${KVS:-auto fp8}; do
    flags=(); [ "$mode" = async ] && flags=(--async-scheduling)
    tag="${kv}_${mode}"
    timeout "${E2E_TIMEOUT:-140}" python3 -m server bench throughput --model deepseek-v2-lite --device cuda --kv-cache-dtype "$kv" \
      --input-len 8192 --output-len 1024 --num-prompts "$n" --max-model-len 9280 --disable-tqdm \
      "${flags[@]}" "${extra[@]}" --output-json "$OUT/e2e_$tag.json" > "$OUT/e2e_$tag.log" 2>&1
    echo "e2e $tag rc=$?"
  done
done
echo "==== summary"
for f in "$OUT"/e2e_*.log; do echo "-- $(basename "$f" .log)"; grep -E "Throughput" "$f" || tail -3 "$f"
  sed -n '/==== Step profile/,/^engine steps:/p' "$f"; done
