#!/usr/bin/env bash
# Prefix-heavy serving: every request shares one random system prompt of PREFIX tokens, then
# INPUT tokens of its own; TTFT p50/p99 with prefix caching on and off (one server per arm,
# random weights in MODEL's shape). ~2 x (start-up + run) seconds.
#   source .device-wheels/install.sh && bash benchmarks/run_prefix_serve.sh [MODEL] [NUM_PROMPTS]
# Env: PREFIX (4096), INPUT (256), OUTPUT (64), CONCURRENCY (32), KV (fp8), PORT (8011),
# DEVICE (cuda), ARMS ("on off": which prefix-caching arms run). Logs and result JSON land in $OUT; a summary table last.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/mlaserve-prefix}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
model=${1:-deepseek-v2-lite}
n=${2:-256}
PREFIX=${PREFIX:-4096} INPUT=${INPUT:-256} OUTPUT=${OUTPUT:-64} CONCURRENCY=${CONCURRENCY:-32}
KV=${KV:-fp8} PORT=${PORT:-8011} DEVICE=${DEVICE:-cuda} ARMS=${ARMS:-on off}
ckpt=$model
if [ ! -d "$model" ]; then  # a preset name: its config and tokenizer, random weights (--load-format dummy)
  ckpt=$(mktemp -d /tmp/mlaserve-prefix-ckpt.XXXX)
  python3 -c "import sys; from model.checkpoint import load_config_dict, write_checkpoint_metadata as w; \
w(load_config_dict(sys.argv[1]), sys.argv[2])" "$model" "$ckpt" || exit 1
  dummy=(--load-format dummy)
else
  dummy=()
fi
for arm in $ARMS; do
  flag=--enable-prefix-caching; [ $arm = off ] && flag=--no-enable-prefix-caching
  python3 -m server serve "$ckpt" "${dummy[@]}" --device "$DEVICE" --kv-cache-dtype "$KV" --port "$PORT" \
    --max-model-len $((PREFIX + INPUT + OUTPUT + 64)) --async-scheduling $flag > "$OUT/server_$arm.log" 2>&1 &
  pid=$!
  python3 -m server bench serve --port "$PORT" --ready-check-timeout-sec 600 --num-prompts "$n" \
    --random-prefix-len "$PREFIX" --random-input-len "$INPUT" --random-output-len "$OUTPUT" \
    --max-concurrency "$CONCURRENCY" --metric-percentiles 50,99 --percentile-metrics ttft,tpot,e2el \
    --save-result --save-detailed --result-dir "$OUT" --result-filename "prefix_$arm.json" --disable-tqdm \
    > "$OUT/bench_$arm.log" 2>&1
  echo "prefix caching $arm: bench rc=$?"
  python3 -c "import urllib.request as u; print(''.join(l for l in u.urlopen('http://localhost:$PORT/metrics').read().decode().splitlines(True) if l.startswith('vllm:prefix_cache')))" \
    >> "$OUT/bench_$arm.log" 2>&1
  kill -INT $pid; wait $pid 2>/dev/null
done
echo "==== summary ($model, $n requests, shared prefix $PREFIX + $INPUT own tokens, $OUTPUT out, concurrency $CONCURRENCY, KV $KV)"
for arm in $ARMS; do echo "-- prefix caching $arm"; grep -E "TTFT|throughput|Successful|prefix_cache" "$OUT/bench_$arm.log" || tail -5 "$OUT/bench_$arm.log"; done
# TTFT of the first wave (the first CONCURRENCY requests to start: no prefix cached yet) vs the rest
for arm in $ARMS; do python3 - "$OUT/prefix_$arm.json" "$CONCURRENCY" "$arm" <<'PY'
import json, statistics, sys
d, wave, arm = json.load(open(sys.argv[1])), int(sys.argv[2]), sys.argv[3]
order = sorted(range(len(d["ttfts"])), key=lambda i: d["start_times"][i])
ms = [1000 * d["ttfts"][i] for i in order if d["ttfts"][i] is not None]
first, rest = ms[:wave], ms[wave:]
print(f"-- {arm}: TTFT p50 first wave {statistics.median(first):.0f} ms, later requests "
      f"{statistics.median(rest) if rest else float('nan'):.0f} ms (max {max(rest) if rest else float('nan'):.0f})")
PY
done
