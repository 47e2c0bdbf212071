#!/usr/bin/env bash
# llama.cpp through llama-cpp-python, built from source (~8 min). The ISA is spelled out, not GGML_NATIVE:
# some VMs of this kind advertise AMX that traps (SIGILL), so AMX is always off, and AVX-512 is enabled
# only where /proc/cpuinfo has it (the AMD EPYC hosts have AVX2 only).
set -euo pipefail
source "$(dirname "$0")/env.sh"
V="$VENVS/llamacpp"
if test -f "$V/.installed"; then exit 0; fi
make_venv llamacpp
flags=$(grep -m1 '^flags' /proc/cpuinfo)
has() { [[ " $flags " == *" $1 "* ]] && echo ON || echo OFF; }
export CMAKE_BUILD_PARALLEL_LEVEL=2
export CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=$(has avx) -DGGML_AVX2=$(has avx2) -DGGML_FMA=$(has fma) \
-DGGML_F16C=$(has f16c) -DGGML_BMI2=$(has bmi2) -DGGML_AVX_VNNI=$(has avx_vnni) -DGGML_AVX512=$(has avx512f) \
-DGGML_AVX512_VBMI=$(has avx512vbmi) -DGGML_AVX512_VNNI=$(has avx512_vnni) -DGGML_AVX512_BF16=$(has avx512_bf16) \
-DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
echo "CMAKE_ARGS=$CMAKE_ARGS" | tee "$V/cmake_args.txt"
nice -n 10 "$V/bin/pip" install --quiet --no-cache-dir "llama-cpp-python[server]==0.3.36"
touch "$V/.installed"
"$V/bin/python" -c 'import llama_cpp; print("llama-cpp-python:", llama_cpp.__version__)'
