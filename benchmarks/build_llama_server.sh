#!/usr/bin/env bash
# Build llama.cpp's llama-server from the sources vendored in the llama-cpp-python sdist,
# with the AMX kernels off (the default build crashes on this CPU's AMX code).
# The binary lands in a cache directory, never in the repo:
#   ${SWASERVE_BENCH_CACHE:-~/.cache/swaserve-bench}/llama.cpp/build/bin/llama-server
set -euo pipefail
CACHE=${SWASERVE_BENCH_CACHE:-$HOME/.cache/swaserve-bench}
BIN="$CACHE/llama.cpp/build/bin/llama-server"
if [[ -x "$BIN" ]]; then echo "$BIN"; exit 0; fi
mkdir -p "$CACHE" && cd "$CACHE"
if [[ ! -d llama-cpp-python-src ]]; then
  pip download --no-binary :all: --no-deps llama-cpp-python==0.3.36 -d sdist >&2
  mkdir -p llama-cpp-python-src && tar -xzf sdist/llama_cpp_python-0.3.36.tar.gz -C llama-cpp-python-src --strip-components=1
fi
mkdir -p llama.cpp
cmake -S llama-cpp-python-src/vendor/llama.cpp -B llama.cpp/build -DLLAMA_BUILD_SERVER=ON -DLLAMA_CURL=OFF \
  -DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON \
  -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF -DCMAKE_BUILD_TYPE=Release >&2
cmake --build llama.cpp/build -j2 --target llama-server >&2
echo "$BIN"
