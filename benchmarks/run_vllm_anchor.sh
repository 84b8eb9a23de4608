#!/usr/bin/env bash
# vLLM and mlaserve on the same workload in one device call: random 8192 in / 1024 out, 100
# prompts, random-weight V2-Lite shape (vLLM's --load-format dummy over our config and tokenizer);
# ours is run_e2e.sh's --async-scheduling arm.
#   VLLM_SITE=/dir/with/vllm bash benchmarks/run_vllm_anchor.sh [KV ...]     # KV: fp8 (default), auto
# VLLM_SITE is a pip --target folder holding vLLM and its dependencies beside the device's torch.
# vLLM's FlashInfer sampler is turned off: on a fresh machine its JIT build takes minutes, longer
# than the benchmark. Ours is timed with whatever kernel caches the machine has (on a cold one the
# first compiles land inside the timed region). Logs land in $OUT; throughput lines printed last.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/mlaserve-anchor}
mkdir -p "$OUT"
: "${VLLM_SITE:?set VLLM_SITE to the folder vLLM is installed in}"
export PYTHONUNBUFFERED=1
model_dir=/tmp/v2lite-metadata
python3 -c "from model.checkpoint import write_checkpoint_metadata, load_config_dict
write_checkpoint_metadata(load_config_dict('deepseek-v2-lite'), '$model_dir')"
kvs=("$@"); [ ${#kvs[@]} -eq 0 ] && kvs=(fp8)
for kv in "${kvs[@]}"; do
  VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 PYTHONPATH="$VLLM_SITE" timeout 280 \
    python3 -m vllm.entrypoints.cli.main bench throughput --model "$model_dir" --load-format dummy \
    --dataset-name random --random-input-len 8192 --random-output-len 1024 --num-prompts 100 \
    --kv-cache-dtype "$kv" --max-model-len 9280 > "$OUT/vllm_$kv.log" 2>&1
  echo "vllm $kv rc=$?"
done
KVS="${kvs[*]}" MODES=async OUT="$OUT" bash benchmarks/run_e2e.sh 100
for f in "$OUT"/vllm_*.log; do echo "-- $(basename "$f" .log)"; grep -E "^Throughput" "$f" || tail -3 "$f"; done
