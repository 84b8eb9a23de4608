#!/usr/bin/env bash
# One device call for the engine on GPU: CUDA-graph correctness, decode-step time with and
# without graphs, and the seed's end-to-end workload (random 8192 in / 1024 out) on a
# random-weight DeepSeek-V2-Lite-shaped model with a bf16 and an FP8 KV cache.
#   source .device-wheels/install.sh && bash benchmarks/run_e2e.sh [NUM_PROMPTS]
# Logs land in $OUT; a summary is printed last.
set -uo pipefail
OUT=${OUT:-/tmp/mlaserve-e2e}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
n=${1:-100}
git rev-parse --short HEAD 2>/dev/null > "$OUT/commit.txt"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/env.txt"

timeout 100 python3 -m pytest -m gpu tests/server/test_cuda_graphs.py -q -p no:cacheprovider > "$OUT/pytest.log" 2>&1
echo "graph test rc=$?"; tail -3 "$OUT/pytest.log"

timeout 120 python3 benchmarks/bench_decode_graphs.py --model deepseek-v2-lite --batch 1 2 4 8 --context 512 \
  --steps 20 --output-json "$OUT/decode_graphs.json" > "$OUT/decode_graphs.log" 2>&1
echo "decode graphs rc=$?"

for kv in auto fp8; do
  timeout 200 python3 -m server bench throughput --model deepseek-v2-lite --device cuda --kv-cache-dtype $kv \
    --input-len 8192 --output-len 1024 --num-prompts "$n" --max-model-len 9280 --disable-tqdm --step-profile \
    --output-json "$OUT/e2e_$kv.json" > "$OUT/e2e_$kv.log" 2>&1
  echo "e2e $kv rc=$?"
done
echo "==== summary"
tail -7 "$OUT/decode_graphs.log"
for kv in auto fp8; do echo "-- kv $kv"; grep -E "Throughput|Total num" "$OUT/e2e_$kv.log" || tail -5 "$OUT/e2e_$kv.log"
  sed -n '/==== Step profile/,/^engine steps:/p' "$OUT/e2e_$kv.log"; done
