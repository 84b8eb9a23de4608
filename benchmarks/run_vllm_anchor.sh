#!/usr/bin/env bash
# vLLM and mlaserve on the same workload in one device call: random 8192 in / 1024 out, 100
# prompts, random-weight V2-Lite shape (vLLM's --load-format dummy over our config and tokenizer).
#   VLLM_SITE=/dir/with/vllm bash benchmarks/run_vllm_anchor.sh [KV ...]     # KV: fp8, auto
# VLLM_SITE is a pip --target folder holding vLLM and its dependencies beside the device's torch.
# vLLM's FlashInfer sampler is turned off: on a fresh machine its JIT build takes minutes, longer
# than the benchmark. Run ours after a warm-up run when the kernel caches are cold (first-call
# compiles land inside the timed region). Logs land in $OUT; throughput lines printed last.
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
  timeout 200 python3 -m server bench throughput --model deepseek-v2-lite --device cuda --kv-cache-dtype "$kv" \
    --input-len 8192 --output-len 1024 --num-prompts 100 --max-model-len 9280 --disable-tqdm \
    --async-scheduling --output-json "$OUT/ours_$kv.json" > "$OUT/ours_$kv.log" 2>&1
  echo "ours $kv rc=$?"
done
for f in "$OUT"/vllm_*.log "$OUT"/ours_*.log; do echo "-- $(basename "$f" .log)"; grep -E "^Throughput" "$f" || tail -3 "$f"; done
