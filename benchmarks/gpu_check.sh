#!/usr/bin/env bash
# One bounded pass over a bare GPU machine: install, the correctness subset on the device,
# then three benchmarks. Every step runs under its own `timeout`; $OUT/summary.txt gets one
# line per step (name, exit code, seconds) whatever fails.
#
# The device machine reaches no registry and takes a working tree of 64 MiB at most, so what
# its image lacks travels in the git-ignored folder .gpucheck/, filled beforehand on a
# machine with the bundled model and pip access:
#
#   bash benchmarks/gpu_check.sh --prepare          # here: wheels + model config/tokenizer
#   bash benchmarks/gpu_check.sh                    # there, with .gpucheck carried
#   OUT=/tmp/gpucheck-out bash benchmarks/gpu_check.sh --device cpu --quick --no-install
#
# Options: --device cuda|cpu (default cuda), --quick (small sizes: the CPU rehearsal),
# --no-install (use the environment as it is), --prepare (fill .gpucheck/ and stop).
# Output under $OUT (default /tmp/gpucheck-out), at most 7 files: summary.txt, env.txt,
# steps.log, tests.log and a JSON per benchmark.

set -uo pipefail

DEVICE=cuda
QUICK=0
INSTALL=1
PREPARE=0
while [ $# -gt 0 ]; do
    case "$1" in
        --device) DEVICE="$2"; shift 2 ;;
        --device=*) DEVICE="${1#*=}"; shift ;;
        --quick) QUICK=1; shift ;;
        --no-install) INSTALL=0; shift ;;
        --prepare) PREPARE=1; shift ;;
        -h|--help) sed -n '2,19p' "$0"; exit 0 ;;
        *) echo "gpu_check.sh: unknown option $1" >&2; exit 2 ;;
    esac
done
case "$DEVICE" in cpu|cuda) ;; *) echo "gpu_check.sh: --device cpu or cuda" >&2; exit 2 ;; esac

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT" || exit 2
CARRY="$ROOT/.gpucheck"
PY="${PYTHON:-python3}"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 SWASERVE_NO_PROGRESS=1

# Packages the device image lacks that the selected tests import (KINDS.md lists the image);
# the versions are the ones installed here, built for the image's Python (GPUCHECK_PYVER
# names another, for a rehearsal of the install step on this machine).
WHEELS="llguidance jsonschema jsonschema-specifications referencing rpds-py"
PYVER="${GPUCHECK_PYVER:-3.12}"
# the build backend for the editable install, whatever setuptools the image has: an older
# one needs the `wheel` package for it (--no-build-isolation, since nothing is fetched)
BUILD_WHEELS="setuptools"

if [ "$PREPARE" = 1 ]; then
    set -e
    rm -rf "$CARRY"
    mkdir -p "$CARRY/wheels" "$CARRY/build"
    for pkg in $WHEELS $BUILD_WHEELS; do
        ver="$("$PY" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$pkg")"
        dest="$CARRY/wheels"
        case " $BUILD_WHEELS " in *" $pkg "*) dest="$CARRY/build" ;; esac
        # pip matches a manylinux_2_N tag only where N is named
        "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$PYVER" \
            --implementation cp $(for n in 17 24 27 28 31 34 35; do
                echo --platform manylinux_2_${n}_x86_64; done) \
            --platform manylinux2014_x86_64 --platform any -d "$dest" "$pkg==$ver"
    done
    "$PY" benchmarks/bench_checkpoint.py "$CARRY/model" --prepare
    gzip -9 "$CARRY/model/tokenizer.json"  # 33 MB of JSON; the tree may carry 64 MiB
    du -sh "$CARRY"/*
    echo "carry .gpucheck with the call: run(command='bash benchmarks/gpu_check.sh', carry=['.gpucheck'])"
    exit 0
fi

OUT="${OUT:-/tmp/gpucheck-out}"
mkdir -p "$OUT"
SUMMARY="$OUT/summary.txt"
LOG="$OUT/steps.log"
: >"$SUMMARY"
: >"$LOG"
WORK="$(mktemp -d /tmp/gpucheck.XXXXXX)"
MODEL="$WORK/model"
# the steps below are shell functions run under `timeout` through `bash -c`
export DEVICE QUICK PY CARRY WORK ROOT MODEL
T_START=$SECONDS
trap 'echo "total - $((SECONDS - T_START))" >>"$SUMMARY"; cat "$SUMMARY"' EXIT

# step NAME LIMIT_S CMD...: run CMD under timeout, its output to steps.log, a summary line
step() {
    local name="$1" limit="$2"; shift 2
    local t0=$SECONDS rc
    echo "=== $name (limit ${limit}s): $*" >>"$LOG"
    timeout -k 10 "$limit" "$@" >>"$LOG" 2>&1
    rc=$?
    [ "$rc" = 124 ] && echo "=== $name: timed out after ${limit}s" >>"$LOG"
    echo "$name $rc $((SECONDS - t0))" >>"$SUMMARY"
    echo "[gpu_check] $name rc=$rc $((SECONDS - t0))s" >&2
    return "$rc"
}

# Step limits in seconds: with the GPU sizes their sum stays under 8 minutes (the device
# lease is 15 minutes, a machine's start included), so a second try still fits.
T_ENV=20 T_INSTALL=45 T_IMPORTS=20 T_MODEL=60
if [ "$QUICK" = 1 ]; then
    LAYERS=(--layers 2)
    OFFLINE=(--batches 1 4 --new-tokens 8 --repeats 1)
    OVERLAP=(--batch 4 --grammar-rows 2 --new-tokens 8 --repeats 1)
    SAMPLER=(--batch 8 --steps 3)
    T_TESTS=300 T_OFFLINE=120 T_OVERLAP=120 T_SAMPLER=120
else
    LAYERS=()
    OFFLINE=(--batches 1 8 32 --new-tokens 64 --repeats 2)
    OVERLAP=(--batch 32 --new-tokens 64 --repeats 3)
    SAMPLER=(--batch 64 --steps 20)
    T_TESTS=120 T_OFFLINE=80 T_OVERLAP=60 T_SAMPLER=50
fi

env_report() {
    echo "date $(date -u +%FT%TZ)  host $(hostname)  device $DEVICE  quick $QUICK"
    command -v nvidia-smi >/dev/null && nvidia-smi \
        --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv
    "$PY" - "$DEVICE" <<'EOF'
import sys
import torch
print(f"python {sys.version.split()[0]} at {sys.executable}")
print(f"torch {torch.__version__}, built for CUDA {torch.version.cuda}, "
      f"cuda available {torch.cuda.is_available()}")
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print(f"{p.name}: {p.total_memory / 2**30:.0f} GiB, {p.multi_processor_count} SMs, "
          f"capability {p.major}.{p.minor}")
# a machine whose torch cannot reach its GPU fails here rather than in every step after
sys.exit(1 if sys.argv[1] == "cuda" and not torch.cuda.is_available() else 0)
EOF
}
export -f env_report
step env "$T_ENV" bash -c env_report
cp "$LOG" "$OUT/env.txt"

# install: the image's torch is the CUDA build its driver takes (no registry to fetch
# another); the project goes in editable and without dependencies, what the image lacks
# from the carried wheels
install() {
    set -e
    if compgen -G "$CARRY/wheels/*.whl" >/dev/null; then
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
            --upgrade --target "$WORK/site" "$CARRY"/wheels/*.whl
    else
        echo "no wheels in $CARRY/wheels: run 'bash benchmarks/gpu_check.sh --prepare' first"
    fi
    if compgen -G "$CARRY/build/*.whl" >/dev/null; then
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
            --target "$WORK/build" "$CARRY"/build/*.whl
    fi
    PYTHONPATH="$WORK/build:$PYTHONPATH" \
        "$PY" -m pip install -q --no-index --no-deps --no-build-isolation -e "$ROOT"
}
if [ "$INSTALL" = 1 ]; then
    export -f install
    step install "$T_INSTALL" bash -c install
    export PYTHONPATH="$PYTHONPATH:$WORK/site"
fi
step imports "$T_IMPORTS" "$PY" -c "import swaserve, swaserve.engine.engine, llguidance, jsonschema, transformers; print(swaserve.__file__)"

# a random-weight checkpoint of the bundled model's shape (the GGUF is too large to carry)
model() {
    set -e
    mkdir -p "$MODEL"
    if [ -f "$CARRY/model/config.json" ]; then
        cp "$CARRY"/model/* "$MODEL"/
        [ -f "$MODEL/tokenizer.json.gz" ] && gunzip "$MODEL/tokenizer.json.gz"
    else  # where the bundled model is installed (the CPU rehearsal)
        "$PY" benchmarks/bench_checkpoint.py "$MODEL" --prepare
    fi
    "$PY" benchmarks/bench_checkpoint.py "$MODEL" --weights "$@"
}
export -f model
step model "$T_MODEL" bash -c 'model "$@"' model "${LAYERS[@]}"

# The correctness subset, by test function names (they stay when files move). One pytest
# run, so that the modules are collected once; a line per category from its verdicts. Test
# modules that import what the device image lacks (the server's fastapi, schemathesis, ...)
# fail to collect there: the selected tests run all the same.
declare -A CATEGORY=(
    [tests:parity]="test_logits_track_transformers_past_the_window_on_the_test_device
        test_chunked_prefill_matches_one_shot_reference test_ragged_mixed_batches_match_alone
        test_all_sliding_and_no_sliding_layouts
        test_prompt_logprobs_equal_transformers_cold_and_after_a_prefix_hit"
    [tests:prefix_hits]="test_exact_repeat_and_shared_prefix_with_new_suffix
        test_prefix_shorter_than_window test_hit_falls_back_to_an_earlier_restorable_point
        test_four_turn_chat_hits_each_previous_turn test_logits_after_hit_equal_cold_logits"
    [tests:batch_invariant]="test_alone_and_in_a_crowd_bitwise
        test_prompts_are_chunked_at_fixed_positions_and_decodes_never_wait
        test_row_blocks_give_every_row_the_bits_it_gets_alone"
    [tests:grammar]="test_twenty_schemas_parse_and_validate_greedy_and_seeded
        test_schema_as_text_and_property_order test_regex_and_ebnf_outputs_match
        test_mixed_batch_rows_equal_alone test_n_completions_each_follow_the_grammar"
    [tests:speculative]="test_output_is_the_non_speculative_output
        test_stops_grammars_and_text_are_the_non_speculative_ones
        test_retraction_prefix_hits_and_overlap_keep_the_output
        test_cache_after_random_accepts_and_rejects_is_the_non_speculative_cache
        test_batch_invariant_mode_takes_drafts_too"
    [tests:tp1]="test_tensor_parallel_size_one_on_the_test_device_is_the_whole_model
        test_shapes_that_do_not_split_are_refused"
)
ORDER="tests:parity tests:prefix_hits tests:batch_invariant tests:grammar tests:speculative tests:tp1"
NAMES=$(for c in $ORDER; do echo ${CATEGORY[$c]}; done | xargs)
KEXPR=$(echo "$NAMES" | sed 's/ / or /g')
T0=$SECONDS
SWASERVE_TEST_DEVICE="$DEVICE" timeout -k 10 "$T_TESTS" "$PY" -m pytest tests -k "$KEXPR" \
    -v -p no:cacheprovider --continue-on-collection-errors --junitxml="$WORK/tests.xml" \
    >"$OUT/tests.log" 2>&1
RC=$?
echo "tests $RC $((SECONDS - T0))" >>"$SUMMARY"
echo "[gpu_check] tests rc=$RC $((SECONDS - T0))s" >&2
# per category, from the -v lines (there even when the run was killed): rc 0 when at least
# one test passed and none failed; seconds from the JUnit file when the run finished
for c in $ORDER; do
    "$PY" - "$OUT/tests.log" "$WORK/tests.xml" "$c" ${CATEGORY[$c]} >>"$SUMMARY" <<'EOF'
import os
import re
import sys
import xml.etree.ElementTree as ET

log, xml, cat, names = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
counts = {"PASSED": 0, "FAILED": 0, "ERROR": 0, "SKIPPED": 0, "XFAIL": 0, "XPASS": 0}
for line in open(log, errors="replace"):
    m = re.match(r"\S+::(test_\w+)(\[[^\]]*\])? (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)", line)
    if m and m.group(1) in names:
        counts[m.group(3)] += 1
seconds = "-"
if os.path.exists(xml):
    cases = [c for c in ET.parse(xml).iter("testcase") if c.get("name", "").split("[")[0] in names]
    seconds = str(round(sum(float(c.get("time", 0)) for c in cases)))
bad = counts["FAILED"] + counts["ERROR"] + counts["XPASS"]
rc = 0 if counts["PASSED"] and not bad else 1
print(f"{cat} {rc} {seconds} passed {counts['PASSED']} failed {counts['FAILED']} "
      f"errors {counts['ERROR']} skipped {counts['SKIPPED']}")
EOF
done

BENCH=(--device "$DEVICE" --model "$MODEL")
step offline_throughput "$T_OFFLINE" "$PY" benchmarks/offline_throughput.py "${BENCH[@]}" \
    "${OFFLINE[@]}" --json "$OUT/offline_throughput.json"
step overlap "$T_OVERLAP" "$PY" benchmarks/overlap.py "${BENCH[@]}" "${OVERLAP[@]}" \
    --json "$OUT/overlap.json"
step sampler_overhead "$T_SAMPLER" "$PY" benchmarks/sampler_overhead.py "${BENCH[@]}" \
    "${SAMPLER[@]}" --json "$OUT/sampler_overhead.json"
rm -rf "$WORK"
