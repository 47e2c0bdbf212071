#!/usr/bin/env bash
# Build llama.cpp's C++ `llama-server` (continuous batching, what llama.cpp's CPU users run; not
# llama-cpp-python's one-request-at-a-time server, install_llamacpp.sh) into build/llama-server/.
# No prebuilt binary runs here (see shared/research/llama-server.md), so it is built from the llama.cpp
# vendored in the sdist of llama-cpp-python==0.3.36 (commit 0c1e57098). 14 min on 2 cores, 27 with other
# load on them; the build folder is 97 MB, the binary a 15 MB static one (libgomp, libstdc++, libc).
# Traps:
# - ISA spelled out, never GGML_NATIVE: some VMs of this kind advertise AMX that traps (SIGILL), so AMX is
#   always off; each other flag is ON only where /proc/cpuinfo lists it. The cpuinfo names differ from
#   the GGML ones: sse4_2 (SSE42), avx512f (AVX512), avx512vbmi (AVX512_VBMI, no underscore).
# - LLAMA_BUILD_UI/LLAMA_USE_PREBUILT_UI OFF, or the build tries to download the web UI (no internet).
# - The sdist has no git history: the commit is passed by hand (LLAMA_BUILD_COMMIT).
# - ISA_CAP=avx512_vnni|avx512|avx2 builds one that stops at that level (as kvstrata's KVSTRATA_CPU_ISA caps its
#   own kernels: avx512_vnni is an Ice Lake Xeon, no bf16) into build/llama-server-<cap>/, to compare the two
#   engines under the same cap on a CPU that has more (benchmarks/llama_server_served.py --cap).
#     benchmarks/peers/install_llama_server.sh     # prints the binary's path last
#     ISA_CAP=avx512_vnni benchmarks/peers/install_llama_server.sh
set -euo pipefail
source "$(dirname "$0")/env.sh"
VERSION=0.3.36
CAP=${ISA_CAP:-}
case "$CAP" in ""|avx2|avx512|avx512_vnni) ;; *) echo "ISA_CAP: one of avx2, avx512, avx512_vnni" >&2; exit 2;; esac
OUT="$PEERS_DIR/build/llama-server${CAP:+-$CAP}"
BIN="$OUT/bin/llama-server"
if test -f "$OUT/.built" && test -x "$BIN"; then echo "$BIN"; exit 0; fi
mkdir -p "$OUT" "$PEER_CACHE/sdist"

SDIST="$PEER_CACHE/sdist/llama_cpp_python-$VERSION.tar.gz"
if ! test -f "$SDIST"; then
    echo "== downloading the llama-cpp-python==$VERSION sdist"
    "$PYTHON" -m pip download --quiet --no-deps --no-binary :all: -d "$PEER_CACHE/sdist" "llama-cpp-python==$VERSION"
fi
SRC="$PEER_CACHE/sdist/llama_cpp_python-$VERSION"
if ! test -f "$SRC/vendor/llama.cpp/CMakeLists.txt"; then
    echo "== extracting $SDIST"
    tar -xzf "$SDIST" -C "$PEER_CACHE/sdist"
fi

flags=$(grep -m1 '^flags' /proc/cpuinfo)
# What each cap hides: every flag above its level.
declare -A ABOVE=([avx2]="avx512f avx512vbmi avx512_vnni avx512_bf16 avx_vnni" [avx512]="avx512_vnni avx512_bf16 avx_vnni"
                  [avx512_vnni]="avx512_bf16 avx_vnni")
hidden=" ${CAP:+${ABOVE[$CAP]}} "
has() { [[ " $flags " == *" $1 "* && "$hidden" != *" $1 "* ]] && echo ON || echo OFF; }
CMAKE_FLAGS=(-DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=OFF
    -DGGML_AVX="$(has avx)" -DGGML_AVX2="$(has avx2)" -DGGML_FMA="$(has fma)" -DGGML_F16C="$(has f16c)"
    -DGGML_BMI2="$(has bmi2)" -DGGML_SSE42="$(has sse4_2)" -DGGML_AVX_VNNI="$(has avx_vnni)"
    -DGGML_AVX512="$(has avx512f)" -DGGML_AVX512_VBMI="$(has avx512vbmi)"
    -DGGML_AVX512_VNNI="$(has avx512_vnni)" -DGGML_AVX512_BF16="$(has avx512_bf16)"
    -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF
    -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF
    -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_COMMIT=0c1e57098)
echo "== configuring: ${CMAKE_FLAGS[*]}"
nice -n 10 cmake -S "$SRC/vendor/llama.cpp" -B "$OUT" "${CMAKE_FLAGS[@]}" > "$OUT/cmake-configure.log"
echo "== building llama-server (-j2, ~14 min; log: $OUT/cmake-build.log)"
start=$SECONDS
nice -n 10 cmake --build "$OUT" --target llama-server -j2 > "$OUT/cmake-build.log" 2>&1 \
    || { tail -30 "$OUT/cmake-build.log"; exit 1; }
printf '%s\n' "${CMAKE_FLAGS[@]}" > "$OUT/bin/cmake_flags.txt"
echo "== built in $(( (SECONDS - start) / 60 )) min $(( (SECONDS - start) % 60 )) s; flags in $OUT/bin/cmake_flags.txt"
"$BIN" --version 2>&1 | head -2
touch "$OUT/.built"
echo "$BIN"
