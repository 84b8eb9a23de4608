#!/usr/bin/env bash
# A/B of the end-to-end workload in one device call: the same `bench throughput` run (random
# 8192 in / 1024 out on a random-weight DeepSeek-V2-Lite-shaped model, FP8 KV cache,
# --async-scheduling) on this tree and on an older tree unpacked beside it, alternating, so that
# both numbers come from the same machine in the same lease (machines differ by ~15 % between
# leases). Prepare the older tree on the CPU machine, e.g.
#   mkdir .baseline && git archive <commit> | tar -x -C .baseline   (git-ignored; carry it)
# then on the device:
#   source .device-wheels/install.sh && bash benchmarks/run_ab_e2e.sh .baseline [NUM_PROMPTS] [ROUNDS]
# Logs and JSON land in $OUT; the summary is printed last.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/mlaserve-ab}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 MLASERVE_KERNEL_CACHE=${MLASERVE_KERNEL_CACHE:-/tmp/mlaserve-kernels}
base=${1:?usage: run_ab_e2e.sh BASELINE_DIR [NUM_PROMPTS] [ROUNDS]}
n=${2:-100}
rounds=${3:-1}
site=${PYTHONPATH#*:}  # the carried wheels, behind the tree's own packages
for r in $(seq 1 "$rounds"); do
  for tree in . "$base"; do
    tag=$([ "$tree" = . ] && echo new || echo base)_r$r
    (cd "$tree" && PYTHONPATH=$PWD:$site timeout "${E2E_TIMEOUT:-200}" python3 -m server bench throughput \
      --model deepseek-v2-lite --device cuda --kv-cache-dtype fp8 --async-scheduling \
      --input-len 8192 --output-len 1024 --num-prompts "$n" --max-model-len 9280 --disable-tqdm \
      --output-json "$OUT/e2e_$tag.json") > "$OUT/e2e_$tag.log" 2>&1
    echo "e2e $tag rc=$?"
  done
done
echo "==== summary"
for f in "$OUT"/e2e_*.log; do echo "-- $(basename "$f" .log): $(grep -E "Throughput" "$f" || tail -2 "$f")"; done
